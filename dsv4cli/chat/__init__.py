"""`dsv4 chat`: conversation state and slash commands (session), rendering (tui), the verb (command)."""
