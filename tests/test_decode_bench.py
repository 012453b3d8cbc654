"""benchmarks/decode_bench.py (issue 41's decoding targets): the "speculative k=2, plain steps only" row runs the
speculative decoder's plain (t = 1) step alone, and says so or fails; run on the CPU with --smoke."""

import contextlib
import importlib.util
import json
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "decode_bench", Path(__file__).resolve().parents[1] / "benchmarks" / "decode_bench.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

PLAIN = "speculative k=2, plain steps only (static, eager on CPU)"


def _rows(tmp_path):
    out = tmp_path / "decode.json"
    assert bench.main(["--smoke", "--decoders", PLAIN, "--output", str(out)]) == 0
    return [r for r in json.loads(out.read_text())["rows"] if r["decoder"] == PLAIN]


def test_plain_steps_only_row_takes_no_speculative_step(tmp_path):
    rows = _rows(tmp_path)
    assert [r["batch"] for r in rows] == [1, 2]
    for row in rows:
        assert "error" not in row
        new_tokens = 8  # --smoke's
        assert row["speculative_steps"] == 0 and row["plain_steps"] == new_tokens - 1
        assert row["forwards"] == new_tokens
        assert row["acceptance_rate"] is None  # nothing drafted was verified
        assert row["equals_t1"]  # greedy plain steps are t = 1 decoding (fp32 on the CPU)


def test_plain_steps_only_row_fails_when_the_decoder_speculates(tmp_path, monkeypatch):
    """Without the patch the schedule opens with speculative steps: the row's check turns it into an error."""
    monkeypatch.setattr(bench, "never_speculate", contextlib.nullcontext)
    rows = _rows(tmp_path)
    assert rows and all("plain steps only: " in r.get("error", "") for r in rows)


def test_targets_compare_compiled_t1_with_the_plain_step():
    args = bench.parse_args(["--targets", "--smoke", "--output", "unused.json"])
    assert PLAIN in args.decoders
    assert not any("always falls back" in name for name in args.decoders)
