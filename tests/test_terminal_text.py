"""Model text printed by `python -m lab run` carries no control characters but newline and tab (issue 31):
a FINAL answer or any generated text with OSC 52 (clipboard), CSI (hide, move, rewrite) or a carriage return
reached the terminal unchanged before."""

from __future__ import annotations

import json

import pytest

from lab.engine.text import json_for_terminal, printable
from lab.tools import cli
from lab.trace import RunFinished, TokenEmitted, Trace

HOSTILE = [
    "Answer: 42\x1b]52;c;cm0gLXJmIH4=\x07",  # OSC 52: put "rm -rf ~" on the clipboard
    "\x1b[8mhidden\x1b[0m\r\tshown\n",  # conceal, then a carriage return to overwrite the line
    "\x9b2J\x9d0;title\x9c\x7f\x00end",  # 8-bit CSI / OSC / ST, DEL, NUL
]
UNSAFE = {chr(c) for c in [*range(0x00, 0x09), *range(0x0B, 0x20), *range(0x7F, 0xA0)]}


def test_printable_keeps_text_newline_and_tab_only() -> None:
    assert printable("".join(HOSTILE)) == "Answer: 42]52;c;cm0gLXJmIH4=[8mhidden[0m\tshown\n2J0;titleend"
    assert printable("ünïcödé\tok\n✓") == "ünïcödé\tok\n✓"
    assert not set(printable("".join(map(chr, range(0x200))))) & UNSAFE


def test_json_for_terminal_is_the_same_value_without_raw_controls() -> None:
    value = {"text": "".join(HOSTILE), "ids": [1, 2]}
    dumped = json_for_terminal(json.dumps(value, ensure_ascii=False))
    assert json.loads(dumped) == value and not set(dumped) & UNSAFE


@pytest.fixture
def fake_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """cmd_run without a model: the runner streams the hostile tokens."""

    def stream_run(request, loaded, prompt_ids, path=None):
        yield from (TokenEmitted(i, i, text, "target", 0.1 * i) for i, text in enumerate(HOSTILE))
        yield RunFinished(3, "eos", 0.3, 2, 3)

    monkeypatch.setattr("lab.app.runner.prepare", lambda request: (None, [1, 2]))
    monkeypatch.setattr("lab.engine.forward_path.choose", lambda loaded, wait=False: None)  # no model here
    monkeypatch.setattr("lab.app.runner.new_trace", lambda request, loaded, path=None: Trace("greedy", "m", "p", {}))
    monkeypatch.setattr("lab.app.runner.stream_run", stream_run)


@pytest.mark.parametrize("as_json", [False, True])
def test_run_prints_no_control_characters(as_json: bool, fake_run, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["run", "--strategy", "greedy", "--prompt", "hi", *(["--json"] if as_json else [])]) == 0
    out = capsys.readouterr().out
    assert not set(out) & UNSAFE - {"\n"}
    if as_json:
        assert json.loads(out)["text"] == "".join(HOSTILE)  # the JSON value is the model's text, unchanged
    else:
        assert out == printable("".join(HOSTILE)) + "\n"
