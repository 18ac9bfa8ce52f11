"""bench on the user's prompts, with the static-hot and prev-token baselines: exact (stock's logits at every
teacher-forced step of every prompt, the random-weight fixtures' default), on the in-process and the capped child
paths. No timings asserted."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import run_cli


def _bench(*args: str) -> dict:
    r = run_cli("bench", "tiny-qwen3moe", "--repeat", "1", "-n", "6", "--json", *args)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_static_hot_and_prev_token_decode_stocks_tokens_on_every_prompt(tmp_path: Path) -> None:
    prompts = tmp_path / "mine.txt"
    prompts.write_text("Why is the sky blue?\n\nWrite a haiku about autumn leaves.\nList three prime numbers.\n")
    out = _bench("--prompts", str(prompts), "--budget", "25%",
                 "--policies", "stock,static-hot,prev-token,on-demand-lru")
    assert out["n_prompts"] == 3 and out["prompts"] == str(prompts) and out["prompt_tokens"] > 3 * 5
    pol = out["policies"]
    assert out["decode"] == "teacher-forced"
    for name in ("static-hot", "prev-token", "on-demand-lru"):
        assert pol[name]["decode"] == "teacher-forced" and pol[name]["same_logits_as_stock"] is True, name
        assert pol[name]["same_tokens_as_stock"] is None, name  # the tokens are the text's, not the model's
        assert pol[name]["hit_rate"] < 1, name  # 8 of 32 slots: misses happened, and were computed exactly
    assert pol["static-hot"]["bytes_per_token"] == 0  # nothing moves during decode
    assert "calibration" in pol["static-hot"]["profile"]
    assert pol["prev-token"]["bytes_per_token"] > 0  # misses waited for, uploaded into slots
    # --prompt-tokens cuts each prompt: 3 prompts of at most 4 tokens
    cut = _bench("--prompts", str(prompts), "--prompt-tokens", "4", "--policies", "stock")
    assert cut["prompt_tokens"] == 12


def test_the_baselines_in_capped_children_read_the_shared_inputs(tmp_path: Path) -> None:
    """The disk tier runs each policy in a child process: prompts and profile reach it through a file."""
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text('{"prompt": "Name a colour."}\n"Count to five."\n')
    out = _bench("--prompts", str(prompts), "--tier", "disk", "--budget", "30%",
                 "--policies", "stock,static-hot,prev-token")
    for name in ("static-hot", "prev-token"):
        assert out["policies"][name]["same_logits_as_stock"] is True, name  # the forced text reached the child
        # 30% of 32 experts is 9.6 slots a layer: the baselines spend what whole rows leave, as the engine does
        assert out["slots_per_layer"] == 9 and 9.5 <= out["policies"][name]["slots_mean"] <= 9.6, name
        # how hard the cap pressed, per run
        assert len(out["policies"][name]["major_faults"]) == 1 and len(out["policies"][name]["cap_hits"]) == 1
    assert out["n_prompts"] == 2


def test_split_benches_the_held_out_prompts_alone(tmp_path: Path) -> None:
    """--split eval keeps a file's held-out prompts only (the packaged file's tune half is what fit-predictor fits
    the learned predictor on, so a bench over the whole file grades it partly on its training text); a split with
    no prompt in the file is one line and exit 2."""
    prompts = tmp_path / "mixed.jsonl"
    prompts.write_text('{"prompt": "Name a colour.", "split": "tune"}\n{"prompt": "Count to five.", "split": "eval"}\n'
                       '{"prompt": "Say hello.", "split": "eval"}\n')
    whole = _bench("--prompts", str(prompts), "--policies", "stock")
    held = _bench("--prompts", str(prompts), "--split", "eval", "--policies", "stock")
    assert whole["n_prompts"] == 3 and whole["split"] is None
    assert held["n_prompts"] == 2 and held["split"] == "eval" and held["prompt_tokens"] < whole["prompt_tokens"]
    packaged = _bench("--split", "eval", "--policies", "stock", "--prompt-tokens", "4")
    assert packaged["prompts"] == "eval_prompts.jsonl" and packaged["n_prompts"] == packaged["prompt_tokens"] // 4
    only_eval = tmp_path / "eval.txt"
    only_eval.write_text("Why is the sky blue?\n")
    r = run_cli("bench", "tiny-qwen3moe", "--prompts", str(only_eval), "--split", "tune")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "no prompts of split 'tune'" in lines[0], r.stderr


def test_a_bad_prompt_file_is_one_line_and_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"prompt": oops}\n')
    for cmd in (["bench", "tiny-qwen3moe"], ["trace", "tiny-qwen3moe", "-o", str(tmp_path / "t.npz")]):
        for f, msg in ((bad, f"{bad}:2: not JSON"), (tmp_path / "missing.txt", "missing.txt: no such prompt file")):
            r = run_cli(*cmd, "--prompts", str(f))
            assert r.returncode == 2, (cmd, r.stderr)
            lines = r.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("pyspecter: error: ") and msg in lines[0], (cmd, lines)
