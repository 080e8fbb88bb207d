"""The chat's conversation state, slash commands and status bar, in process (no model; the bundled tokenizer)."""
import json

from rich.console import Console

from dsv4cli.chat.session import ChatSession, read_message
from dsv4cli.chat.tui import split_reply, status_bar
from dsv4cli.config import BUNDLED_MODEL_DIR, Settings
from dsv4cli.engine import Metrics
from dsv4cli.openai.responses import visible_message
from dsv4cli.tokenizer import Tokenizer

TOK = Tokenizer.from_dir(BUNDLED_MODEL_DIR)


def reply(text: str, thinking: bool = False) -> dict:
    return visible_message(TOK, text, thinking)


def test_status_bar_snapshot():
    m = Metrics(t_submit=0.0, t_first=0.12, t_last=1.32, prompt_tokens=17, output_tokens=41, drafts=16,
                draft_tokens=32, accepted_tokens=24, accepted_per_position=[14, 10], proposed_per_position=[16, 16])
    console = Console(record=True, width=120, color_system=None)
    console.print(status_bar(m, "MTP 2", [0.030, 0.035, 0.050, 0.040, 0.080, 0.030]))
    console.print(status_bar(m, "off", []))
    console.print(status_bar(m, "off", [0.030], "eager, compiling"))
    console.print(status_bar(m, "DSpark auto (block 5)", []))
    assert console.export_text() == (
        "41 tok · 33.3 tok/s · TTFT 120 ms · TPOT 30.0 ms · step ▁▂▄▂█▁ 30.0 ms\n"
        "drafter MTP 2 · accept 75.0% · per position 0.88 0.62 · mean acceptance length 2.50\n"
        "41 tok · 33.3 tok/s · TTFT 120 ms · TPOT 30.0 ms\n"
        "drafter off\n"
        "eager, compiling · 41 tok · 33.3 tok/s · TTFT 120 ms · TPOT 30.0 ms · step ▁ 30.0 ms\n"
        "drafter off\n"
        "41 tok · 33.3 tok/s · TTFT 120 ms · TPOT 30.0 ms\n"
        "drafter DSpark auto (block 5) · verified 2.0 · accept 75.0% · per position 0.88 0.62 · "
        "mean acceptance length 2.50\n")


def test_set_validates_and_takes_flag_spellings():
    s = ChatSession(Settings())
    assert s.command("/set temp 0.5").message == "temperature = 0.5" and s.settings.temperature == 0.5
    bad = s.command("/set temperature -1")
    assert bad.error and bad.message == "/set temperature: must be in [0, 100], got -1.0"
    assert s.settings.temperature == 0.5
    assert s.command("/set max-tokens 7").message == "max_tokens = 7"
    assert s.command("/set n -1").message == "max_tokens = 4096"          # until the context is full
    assert s.command("/set max_tokens 0").message == "/set max_tokens: must be >= 1 or -1, got 0"
    assert s.command("/set thinking on").message == "thinking = true"
    assert s.command("/set mtp 2").message == "drafts = 2" and s.settings.drafts == 2    # the key's old name
    assert s.command("/set seed 3").message == "seed = 3" and s.command("/set seed unset").message == "seed = unset"
    assert s.command('/set stop ["\\n\\n", "END"]').message == 'stop = ["\\n\\n", "END"]'
    assert "did you mean temperature?" in s.command("/set tmperature 1").message
    assert "did you mean /show?" in s.command("/shwo").message
    assert s.command("/set").action == "show" and s.command("/show prompt").part == "prompt"


def test_regen_and_undo():
    s = ChatSession(Settings(thinking=True))
    assert s.command("/regen").error and s.command("/undo").error
    s.add_user("hi")
    kept = s.add_reply(reply("let me think</think>Hello!<｜end▁of▁sentence｜>", True), Metrics(), interrupted=False)
    assert kept == {"role": "assistant", "content": "Hello!", "reasoning_content": "let me think"}
    assert s.prompt().endswith("<｜User｜>hi<｜Assistant｜><think>let me think</think>Hello!<｜end▁of▁sentence｜>")
    assert s.command("/regen").action == "reply" and s.messages == [{"role": "user", "content": "hi"}]
    s.add_reply(reply("unfinished thou", True), Metrics(), interrupted=True)
    assert s.messages[-1] == {"role": "assistant", "content": "", "reasoning_content": "unfinished thou",
                              "interrupted": True}
    assert s.totals.replies == 2 and s.totals.interrupted == 1
    s.command("/undo")
    assert s.messages == []


def test_save_load_round_trip(tmp_path):
    s = ChatSession(Settings())
    s.command("/system Be brief.")
    s.command("/set temperature 0.25")
    s.add_user("hi")
    s.add_reply(reply("Hel"), Metrics(), interrupted=True)
    path = tmp_path / "chat.json"
    assert not s.command(f"/save {path}").error
    data = json.loads(path.read_text())
    assert data["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                                {"role": "assistant", "content": "Hel", "interrupted": True}]
    assert data["settings"]["temperature"] == 0.25 and "system" not in data["settings"]
    assert [p.name for p in tmp_path.iterdir()] == ["chat.json"]    # no temporary file left behind

    t = ChatSession(Settings())
    assert t.command(f"/load {path}").message == f"loaded 3 messages from {path}"
    assert t.messages == s.messages and t.settings == s.settings
    path.write_text(json.dumps({"messages": [{"role": "robot", "content": "x"}]}))
    assert "unknown role" in t.command(f"/load {path}").message and t.messages == s.messages
    assert t.command(f"/load {tmp_path / 'missing.json'}").error


def test_fit_shows_the_model_the_latest_exchanges_that_fit():
    tok = TOK
    s = ChatSession(Settings(system="Be brief."))
    for i in range(8):
        s.add_user(f"Question {i}?")
        s.add_reply(reply(f"Answer {i}."), Metrics(), interrupted=False)
    s.add_user("Last question?")
    whole = len(tok.encode(s.prompt()))
    ids, hidden = s.fit(tok.encode, whole)
    assert (s.start, hidden, ids) == (0, 0, tok.encode(s.prompt()))
    ids, hidden = s.fit(tok.encode, whole - 1)            # one token short: the oldest exchange goes
    assert (s.start, hidden) == (2, 2) and len(ids) < whole and "Question 0?" not in s.prompt()
    ids, hidden = s.fit(tok.encode, len(tok.encode(s.prompt(14))))
    assert (s.start, hidden) == (14, 12)
    assert s.prompt().startswith("<｜begin▁of▁sentence｜>Be brief.<｜User｜>Question 7?")
    assert s.fit(tok.encode, 1)[1] == 2 and s.start == 16    # the last user message stays, whatever the budget
    assert len(s.transcript) == 18 and s.transcript[1]["content"] == "Question 0?"
    s.command("/undo")
    assert s.start == 16 and s.conversation == [{"role": "system", "content": "Be brief."}]
    s.add_user("Again?")
    assert s.fit(tok.encode, whole)[1] == 0 and s.start == 0  # room again: the model sees everything again


def test_read_message_blocks():
    def reader(lines):
        it = iter(lines)

        def read(prompt):
            try:
                return next(it)
            except StopIteration:
                raise EOFError from None
        return read

    assert read_message(reader(["plain"])) == "plain"
    assert read_message(reader(['"""', "one", "two", '"""'])) == "one\ntwo"
    assert read_message(reader(['"""first', 'last"""'])) == "first\nlast"
    assert read_message(reader(['"""inline"""'])) == "inline"
    assert read_message(reader(['"""cut', "off"])) == "cut\noff"   # end of input closes the block


def test_split_reply():
    """What the chat shows: reasoning apart from the answer, no special tokens, a partial one held back."""
    assert split_reply("a</think>b", True, TOK, final=True) == ("a", "b")
    assert split_reply("still thinking", True, TOK, final=False) == ("still thinking", "")
    assert split_reply("a</think>b", False, TOK, final=True) == ("", "ab")
    raw = "Paris.<｜end▁of▁sentence｜><｜User｜>Hi<｜Assistant｜></think>Hello"
    assert split_reply(raw, False, TOK, final=True) == ("", "Paris.HiHello")
    assert split_reply("Paris.<｜end▁of", False, TOK, final=False) == ("", "Paris.")
    assert split_reply("x</thi", True, TOK, final=False) == ("x", "")



def test_a_transcript_names_no_file_to_read(tmp_path):
    """A transcript's format once named any local file for /load to read into the next reply: /load refuses a
    format that names a file, and /save writes none (and says so)."""
    grammar = tmp_path / "answer.lark"
    s = ChatSession(Settings())
    s.command(f"/set format grammar {grammar}")
    s.add_user("hi")
    path = tmp_path / "chat.json"
    assert s.command(f"/save {path}").message == (f"saved 1 messages to {path} (not the format grammar {grammar}: "
                                                  "/load reads no file a transcript names)")
    data = json.loads(path.read_text())
    assert "format" not in data["settings"]
    t = ChatSession(Settings(format="json"))
    assert not t.command(f"/load {path}").error and t.settings.format == "json"    # its own format stays
    data["settings"]["format"] = "json-schema /etc/passwd"
    path.write_text(json.dumps(data))
    refused = t.command(f"/load {path}")
    assert refused.error and refused.message == (f"/load {path}: settings.format 'json-schema /etc/passwd': a "
                                                 "transcript may not name a file to read (/set format after /load)")
    assert t.settings.format == "json" and t.messages == [{"role": "user", "content": "hi"}]
