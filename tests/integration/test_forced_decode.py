"""Teacher-forced decode (study/forced.py) through llama.cpp: bench's runs feed exactly the held-out text's tokens,
and each step's logits are the ones an independent stock decode of prompt + text gives, bit for bit."""

from __future__ import annotations

from pyspecter.layout import read_layout
from pyspecter.models.tiny import build_tiny
from pyspecter.native import Context, Model
from pyspecter.study.bench import prompt_sets
from pyspecter.study.bench_runs import run_policy, run_specter
from pyspecter.study.forced import FORCED, digest, forced_tokens, heldout_text

N = 6


def _stock(path, prompts, feed) -> list[str]:
    """Digests of the logits each fed token follows: stock llama.cpp, prompt then the fed tokens one by one."""
    out = []
    with Model(path) as m, Context(m, n_ctx=64, n_threads=2) as ctx:
        for prompt, toks in zip(prompts, feed, strict=True):
            ctx.clear()
            logits = ctx.decode(prompt)
            for t in toks:
                out.append(digest(logits))
                logits = ctx.decode([t])
    return out


def test_forced_decode_feeds_exactly_the_texts_tokens() -> None:
    path = build_tiny("tiny-qwen3moe")
    layout = read_layout(path)
    one = prompt_sets(path, None, 24)[0]
    prompts = [one[:12], one[12:]]
    with Model(path) as m:
        texts = forced_tokens(m, len(prompts), N)
        whole = m.tokenize(heldout_text(), add_special=False)
    # prompt i is fed the N tokens from offset i * N of the held-out text (and the one after, never fed)
    assert texts == [whole[0:N + 1], whole[N:2 * N + 1]]
    want = _stock(path, prompts, [t[:N] for t in texts])
    free = run_policy("on-demand-lru", path, layout, layout.n_expert // 2, "ram", prompts, N, 2)
    greedy = _stock(path, prompts, [free.tokens[:N], free.tokens[N:]])
    assert want != greedy  # the text is not what the model would say: forcing it changes the logits
    for run in (run_policy("on-demand-lru", path, layout, layout.n_expert // 2, "ram", prompts, N, 2, forced=texts),
                run_specter(path, None, layout.expert_total_bytes // 2, True, "ram", prompts, N, 2, 4,
                            forced=texts)):
        assert run.decode == FORCED
        assert run.tokens == texts[0][:N] + texts[1][:N]
        assert run.digests == want  # stock's logits, step for step, on the text
        assert len(run.tpots) == 2 * N
