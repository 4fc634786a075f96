"""`kvchat generate`'s sampling knobs on the dev model: each one does what the API's does
(kvchat_testing.sampling_knobs, the checks every transport passes), and a bad value is one
`error:` line and exit code 2."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from kvchat.app.cli.main import app
from kvchat_testing.sampling_knobs import check_sampling_knobs

runner = CliRunner()
PROMPT = ["--prompt", "Hello!", "--chat"]  # as the transports' tests send it


def flags(fields: dict[str, Any]) -> list[str]:
    """The API's sampling fields as `kvchat generate` flags."""
    out: list[str] = []
    for name, value in fields.items():
        flag = "--" + name.replace("_", "-")
        if name == "logit_bias":
            for token, bias in value.items():
                out += [flag, f"{token}={bias}"]
        elif value is True:
            out.append(flag)
        else:
            out += [flag, str(value)]
    return out


def generate(model: Path, *args: str) -> Any:
    return runner.invoke(app, ["generate", "--model", str(model), *PROMPT, *args])


def error_line(result: Any) -> str:
    """The one `error:` line of a refused command (exit code 2, no traceback)."""
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return str(lines[0])


def test_each_knob_does_what_the_apis_does(dev_model: Path) -> None:
    def reply(fields: dict[str, Any]) -> str:
        result = generate(dev_model, *flags(fields), "--json")
        assert result.exit_code == 0, result.output
        return str(json.loads(result.stdout)["text"])

    def refused(fields: dict[str, Any]) -> tuple[int, str | None]:
        """As the API answers: 400 and the field the one error line names first."""
        line = error_line(generate(dev_model, *flags(fields), "--json"))
        named = re.search(r"(?:--)?([a-z]+[_-][a-z_-]+)", line.removeprefix("error: "))
        return 400, named.group(1).replace("-", "_") if named else None

    from kvchat.inference import load_tokenizer

    check_sampling_knobs(load_tokenizer(dev_model), reply, refused)


def test_logit_bias_bans_the_token_greedy_decoding_picks(dev_model: Path) -> None:
    greedy = ["--temperature", "0", "--max-tokens", "4", "--ignore-eos", "--json"]
    plain = json.loads(generate(dev_model, *greedy).stdout)["token_ids"]
    first = plain[0]
    banned = generate(dev_model, *greedy, "--logit-bias", f"{first}=-100")
    assert banned.exit_code == 0, banned.output
    ids = json.loads(banned.stdout)["token_ids"]
    assert first not in ids and ids != plain


def test_repetition_penalty_first_changes_a_token_the_text_already_had(dev_model: Path) -> None:
    """Under greedy decoding a penalty only lowers the logits of tokens seen (the prompt's and
    the reply's): where the penalized reply first parts from the plain one, the plain one
    picked a token it had seen."""
    from kvchat.inference import ChatMessage, load_chat_template, load_tokenizer

    greedy = ["--temperature", "0", "--max-tokens", "12", "--ignore-eos", "--json"]
    plain = json.loads(generate(dev_model, *greedy).stdout)["token_ids"]
    assert len(set(plain)) < len(plain), plain  # the dev model repeats under greedy decoding
    result = generate(dev_model, *greedy, "--repetition-penalty", "2")
    assert result.exit_code == 0, result.output
    penalized = json.loads(result.stdout)["token_ids"]
    assert penalized != plain
    at = next(i for i, (a, b) in enumerate(zip(plain, penalized, strict=True)) if a != b)
    tokenizer = load_tokenizer(dev_model)
    assert tokenizer is not None
    prompt = load_chat_template(dev_model, tokenizer).render_ids([ChatMessage("user", "Hello!")])
    assert plain[at] in {*prompt, *plain[:at]}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--presence-penalty", "2.5"], "presence_penalty must be in [-2, 2], got 2.5"),
        (["--frequency-penalty", "-3"], "frequency_penalty must be in [-2, 2], got -3.0"),
        (["--repetition-penalty", "0"], "repetition_penalty must be in (0, 2], got 0.0"),
        (["--repetition-penalty", "2.01"], "repetition_penalty must be in (0, 2]"),
        (["--min-p", "1.5"], "min_p must be in [0, 1], got 1.5"),
        (["--min-p", "nan"], "min_p must be in [0, 1], got nan"),
        (["--logit-bias", "5"], "--logit-bias must be ID=BIAS (a token id and a number), got '5'"),
        (["--logit-bias", "cat=1"], "--logit-bias must be ID=BIAS"),
        (["--logit-bias", "5=strong"], "--logit-bias must be ID=BIAS"),
        (["--logit-bias", "-3=1"], "logit_bias keys must be token ids (integers >= 0), got -3"),
        (["--logit-bias", "5=101"], "logit_bias values must be in [-100, 100], got 101.0"),
        (["--logit-bias", "5=1", "--logit-bias", "5=2"], "logit_bias names a token twice"),
        (["--logit-bias", "100277=1"], "logit_bias names token id 100277, outside the vocabulary"),
    ],
)
def test_a_bad_knob_is_one_error_line(dev_model: Path, args: list[str], message: str) -> None:
    assert message in error_line(generate(dev_model, "--max-tokens", "2", *args))


def test_knobs_at_their_bounds_are_taken(dev_model: Path) -> None:
    result = generate(
        dev_model,
        "--max-tokens",
        "2",
        "--presence-penalty",
        "-2",
        "--frequency-penalty",
        "2",
        "--repetition-penalty",
        "2",
        "--min-p",
        "1",
        "--logit-bias",
        "0=-100",
        "--logit-bias",
        "100276=100",
        "--json",
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["completion_tokens"] == 2
