"""A terminal that rewraps its lines when it is resized, as VTE, iTerm2, kitty, Windows Terminal and tmux do:
enough of one to replay what a program wrote to a pseudo-terminal (printable text, CR, LF, cursor up, erase
line; colours and other sequences ignored) and read back every row, scrollback included."""
import math
import re

SEQUENCE = re.compile(r"\x1b\[([0-9;?]*)([A-Za-z])|\x1b[()][A-Za-z0-9]|\x1b.")


class RewrappingTerminal:
    def __init__(self, width: int, height: int):
        self.width, self.height = width, height
        self.rows: list[list] = [["", False]]     # [text, wrapped onto the next row], scrollback then screen
        self.row = self.col = 0

    def _top(self) -> int:
        return max(0, len(self.rows) - self.height)

    def _down(self) -> None:
        self.row += 1
        if self.row == len(self.rows):
            self.rows.append(["", False])

    def _put(self, ch: str) -> None:
        if self.col == self.width:                # the pending wrap: this row goes on below
            self.rows[self.row][1] = True
            self._down()
            self.col = 0
        text = self.rows[self.row][0].ljust(self.col)
        self.rows[self.row][0] = text[:self.col] + ch + text[self.col + 1:]
        self.col += 1

    def feed(self, data: str) -> None:
        at = 0
        for m in SEQUENCE.finditer(data):
            self._text(data[at:m.start()])
            at = m.end()
            args, op = m.group(1), m.group(2)
            if op == "A":
                self.row = max(self._top(), self.row - int(args or 1))
            elif op == "K":
                text = self.rows[self.row][0]
                self.rows[self.row] = [text[:self.col] if args in ("", "0") else "", False]
        self._text(data[at:])

    def _text(self, text: str) -> None:
        for ch in text:
            if ch == "\r":
                self.col = 0
            elif ch == "\n":
                self._down()
            elif ch >= " ":
                self._put(ch)

    def resize(self, width: int) -> None:
        """Join each line's soft-wrapped rows and wrap it again at `width`; the cursor stays on its character."""
        lines, cursor, current = [], None, ""
        for i, (text, wrapped) in enumerate(self.rows):
            if i == self.row:
                cursor = (len(lines), len(current) + self.col)
            current += text.ljust(self.width) if wrapped else text
            if not wrapped:
                lines.append(current)
                current = ""
        if current:
            lines.append(current)
        self.width, self.rows = width, []
        for i, line in enumerate(lines):
            count = max(1, math.ceil(len(line) / width))
            if i == cursor[0]:
                self.row = len(self.rows) + min(cursor[1] // width, count - 1)
                self.col = cursor[1] - (self.row - len(self.rows)) * width
            self.rows += [[line[j * width:(j + 1) * width], j < count - 1] for j in range(count)]

    def lines(self) -> list[str]:
        """Every line as the program wrote it, soft wraps joined."""
        out, current = [], ""
        for text, wrapped in self.rows:
            current += text
            if not wrapped:
                out.append(current.rstrip())
                current = ""
        return out
