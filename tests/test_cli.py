"""`python -m dsr1 generate` and `chat` as a user runs them: on the embedded demo model (the default) and the
random tiny model."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest

from dsr1.__main__ import _parser, main, run_chat


@pytest.mark.slow
def test_generate_streams_text_and_reports_speed(capsys):
    assert main(["generate", "--preset", "tiny", "--prompt", "Hello", "--prompt", "你好", "--max-new-tokens", "6",
                 "--no-warmup", "--temperature", "0.7", "--seed", "3", "--stop", "\n\n\n"]) == 0
    out, err = capsys.readouterr()
    assert "RANDOM weights" in err and "the text is noise" in err
    assert "prefill:" in err and "decode:" in err and "tok/s" in err
    assert "--- prompt 2:" in out


@pytest.mark.slow
def test_chat_repl_keeps_the_conversation(capsys):
    args = _parser().parse_args(["chat", "--max-new-tokens", "4", "--system", "Be brief."])
    assert run_chat(args, stdin=io.StringIO("Hi there\nAnd now?\n/reset\nFresh start\n/exit\n")) == 0
    err = capsys.readouterr().err
    assert "demo_model" in err and "RANDOM" not in err
    assert err.count("r1> ") == 3 and err.count("decode:") == 3


def test_chat_template_kwargs_flag():
    args = _parser().parse_args(["generate", "--chat", "--chat-template-kwargs", '{"thinking": true}'])
    assert args.chat_template_kwargs == {"thinking": True}
    assert _parser().parse_args(["chat"]).chat_template_kwargs is None
    for bad in ("{thinking}", "[1]"):
        with pytest.raises(SystemExit):
            _parser().parse_args(["generate", "--chat-template-kwargs", bad])


@pytest.mark.slow
def test_bad_values_fail_clearly():
    proc = subprocess.run([sys.executable, "-m", "dsr1", "generate", "--top-p", "1.5", "--no-warmup"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "error: Sampling.top_p" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "dsr1", "--help"], capture_output=True, text=True, timeout=60)
    assert "generate" in proc.stdout and "chat" in proc.stdout
