"""Plain helper functions and constants shared by several test modules (fixtures live in conftest.py).

Test modules import from here (`from tests.helpers import ...`), never from one another.
"""

from __future__ import annotations

import itertools
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch

# ---- HF transformers as the oracle ------------------------------------------------------------------------------


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    """HF's greedy continuation of `ids`, `n` tokens, never stopping early (like ignore_eos)."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          do_sample=False, max_new_tokens=n, min_new_tokens=n, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def sharp_llama(directory: Path, seed: int, **config: Any):
    """A random HF Llama (fp32, eval) with sharp next-token distributions (lm_head x4), saved to `directory`;
    returns (HF model, our LlamaModel loaded from the directory)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from verispec.models.loader import load_model

    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(LlamaConfig(**config)).eval()
    with torch.no_grad():
        hf.lm_head.weight.mul_(4.0)
    hf.save_pretrained(directory)
    model, _ = load_model(str(directory), dtype="float32", device="cpu")
    return hf, model


def self_distilled_data(hf, model, target_dir, path: Path, n: int, shard_size: int, seed: int = 5,
                        response: int = 28) -> Path:
    """`n` training sequences (a random prompt of 3-6 tokens + HF's greedy response) with every layer's hidden
    states, written as `verispec train data` shards of `shard_size` sequences of the target at `target_dir`."""
    from verispec.execution.features import target_features
    from verispec.train.shards import shard_name, write_meta, write_shard

    L, V = model.cfg.num_layers, model.cfg.vocab_size
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for _ in range(n):
        prompt = torch.randint(1, V, (int(torch.randint(3, 7, (1,), generator=g)),), generator=g).tolist()
        ids = prompt + hf_greedy(hf, prompt, response)
        _, out = target_features(model, ids, range(L + 1))
        seqs.append((ids, len(prompt), {i: out.hidden[i] for i in range(L + 1)}, out.last_hidden))
    shards = list(range((n + shard_size - 1) // shard_size))
    for i in shards:
        write_shard(path / shard_name(i), seqs[i * shard_size : (i + 1) * shard_size])
    write_meta(path, {"model": str(target_dir), "num_layers": L, "hidden_size": model.cfg.hidden_size,
                      "layers": list(range(L + 1)), "shards": shards, "num_sequences": n})
    return path


# ---- statistics -------------------------------------------------------------------------------------------------


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit, bins with expected < 5 merged into one."""
    from scipy.stats import chi2

    n = counts.sum().item()
    exp = probs * n
    small = exp < 5
    obs = torch.cat([counts[~small], counts[small].sum(0, keepdim=True)]) if small.any() else counts
    e = torch.cat([exp[~small], exp[small].sum(0, keepdim=True)]) if small.any() else exp
    keep = e > 0
    stat = ((obs[keep] - e[keep]) ** 2 / e[keep]).sum().item()
    return float(chi2.sf(stat, int(keep.sum()) - 1))


# ---- the tiny Llama with the default model's tokenizer (fixtures `tiny_dir`, `hf`, `tok` in conftest.py) --------

CTX = 256  # its max_position_embeddings
VOCAB = 49152  # the default model's tokenizer
EOS = 2


def make_app(tiny_dir: Path, speculative_config: dict | None = None, scheduler: str = "static", **kw: Any):
    """The server app over a fresh LLM + BackgroundEngine on `tiny_dir`; returns (app, engine)."""
    from verispec import LLM
    from verispec.engine.background import BackgroundEngine
    from verispec.server.app import create_app

    llm = LLM(str(tiny_dir), dtype="float32", progress=False, speculative_config=speculative_config,
              scheduler=scheduler, max_num_seqs=kw.pop("max_num_seqs", 4),
              enable_prefix_caching=kw.pop("enable_prefix_caching", False))
    engine = BackgroundEngine(llm.engine, llm.check_prompt_ids, max_waiting=kw.pop("max_waiting", 64))
    return create_app(llm, engine, **kw), engine


@contextmanager
def serving(app, shutdown_timeout: float | None = None) -> Iterator[tuple[str, Any, threading.Thread]]:
    """`app` on uvicorn at a free local port in a daemon thread; yields (base URL, server, thread)."""
    from verispec.server.app import make_server

    urls: list[str] = []
    server = make_server(app, "127.0.0.1", 0, log_level="warning", on_ready=urls.append,
                         shutdown_timeout=shutdown_timeout)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not urls:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.01)
    try:
        yield urls[0], server, thread
    finally:
        server.should_exit = True
        thread.join(30)


@contextmanager
def live(app) -> Iterator[str]:
    """`app` served by uvicorn on a free local port in a daemon thread; yields its base URL."""
    with serving(app) as (url, _, _):
        yield url


# ---- exact sequence distributions of a tiny-vocabulary target (the lossless-sampling tests) ---------------------

V, LENGTH, N = 5, 3, 20000  # vocabulary, continuation length, samples
PROMPT = [0, 3, 1]


def tiny_vocab_model(path, seed: int, scale: float):
    """A random 1-layer Llama over V tokens saved to `path`; lm_head scaled by `scale`. Returns the HF model."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=False)
    m = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(scale)  # peakier distributions make a biased sampler easier to see
    m.save_pretrained(path)
    return m


def random_eagle3_head(model, out) -> None:
    """An EAGLE-3 head with random weights for a tiny-vocabulary (V = 5) target `model`, saved to `out`: near-uniform
    q (accepted often enough, still != p), draft ids 0..3 -> target ids 0, 1, 3, 4 (token 2 undraftable)."""
    from verispec.drafters.eagle3 import Eagle3Config, Eagle3Head

    torch.manual_seed(11)
    head = Eagle3Head(Eagle3Config.for_target(model, (0, 1), draft_vocab_size=4), model)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.1)
        head.d2t.copy_(torch.tensor([0, 0, 1, 1]))
        head.t2d[torch.tensor([0, 1, 3, 4])] = True
    head.save_pretrained(out)


def random_dspark(model, out, dspark: bool = True) -> None:
    """A DSpark (Markov head; `dspark=False`: plain DFlash) block drafter with random weights for a tiny target
    `model`, block size 4, saved to `out`: near-uniform q, accepted often enough, still != p."""
    from verispec.drafters.dflash_model import DFlashConfig, DFlashModel, TargetParts

    torch.manual_seed(12)
    extra = {"dspark": True, "markov_rank": 4} if dspark else {}
    cfg = DFlashConfig.for_target(model.cfg, num_layers=1, block_size=4, target_layer_ids=(0,), **extra)
    m = DFlashModel(cfg, TargetParts.of(model))
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.1)
    m.save_pretrained(out)


def exact_distribution(hf, length: int = LENGTH) -> torch.Tensor:
    """P(x1 .. x_length | PROMPT) for all V^length continuations, from HF's forward, rows in continuation_index
    order."""
    seqs = torch.tensor(list(itertools.product(range(V), repeat=length)))  # [V^length, length]
    ids = torch.cat([torch.tensor(PROMPT).expand(len(seqs), -1), seqs], 1)
    with torch.no_grad():
        logp = hf(ids).logits.log_softmax(-1)  # [V^3, len, V]
    n0 = len(PROMPT)
    picked = logp[:, n0 - 1 : n0 - 1 + length].gather(-1, seqs.unsqueeze(-1)).squeeze(-1)  # [V^length, length]
    return picked.sum(-1).exp()


def continuation_index(tokens: list[int]) -> int:
    """The row of a continuation in exact_distribution's table of its length."""
    idx = 0
    for t in tokens:
        idx = idx * V + t
    return idx


def batched_counts(llm, n: int, batch: int = 16, length: int = LENGTH) -> tuple[torch.Tensor, list]:
    """n seeded continuations of `length` tokens, `batch` requests decoding together: counts per continuation, and
    the outputs."""
    from verispec import SamplingParams

    counts = torch.zeros(V**length)
    outs = []
    for first in range(0, n, batch):
        params = [SamplingParams(temperature=1.0, max_tokens=length, seed=first + i, ignore_eos=True)
                  for i in range(batch)]
        outs += llm.generate([{"prompt_token_ids": PROMPT}] * batch, params, use_tqdm=False)
    for out in outs:
        counts[continuation_index(out.token_ids)] += 1
    return counts, outs


def eagle2_scores(logp, depth: int, topk: int, width: int | None, to_ids=None) -> dict[tuple[int, ...], float]:
    """EAGLE-2's candidate paths simulated from a path -> log-probabilities function: the `topk` children of each
    expanded path, expanding the `width` best newest paths per depth (None: all of them); returns path -> cumulative
    log-probability. `to_ids` maps logp's indices to token ids (a reduced draft vocabulary)."""
    scores: dict[tuple[int, ...], float] = {}
    frontier: list[tuple[int, ...]] = [()]
    for _ in range(depth):
        new = []
        for par in frontier:
            vals, idx = logp(par).topk(topk)
            for v, t in zip(vals.tolist(), (idx if to_ids is None else to_ids(idx)).tolist()):
                scores[par + (t,)] = scores.get(par, 0.0) + v
                new.append(par + (t,))
        frontier = new if width is None else sorted(new, key=lambda p: -scores[p])[:width]
    return scores


def best_paths(scores: dict[tuple[int, ...], float], budget: int) -> set[tuple[int, ...]]:
    """The `budget` most probable paths (ties: shorter first), EAGLE-2's final selection."""
    return set(sorted(scores, key=lambda p: (-scores[p], len(p)))[:budget])


def assert_drawn_without_replacement(tree, first_row: torch.Tensor | None = None) -> None:
    """A sampled tree's rows: each node's is a distribution giving its token mass, and below each parent the j-th
    child's row is the first child's without the earlier children's tokens, renormalised (draws without
    replacement from one q). first_row: the q the root's children must come from, computed by the caller."""
    assert tree.probs is not None and tree.probs.shape[0] == len(tree.tokens)
    siblings: dict[int, list[int]] = {}
    for i, parent in enumerate(tree.parents):
        siblings.setdefault(parent, []).append(i)
    for kids in siblings.values():
        q = tree.probs[kids[0]]
        for j, c in enumerate(kids):
            assert float(tree.probs[c][tree.tokens[c]]) > 0.0
            want = q.clone()
            want[[tree.tokens[e] for e in kids[:j]]] = 0.0
            assert torch.allclose(tree.probs[c], want / want.sum(), atol=1e-6), (c, j)
    if first_row is not None:
        assert torch.allclose(tree.probs[siblings[-1][0]], first_row, atol=1e-6)


def counting_tokenizer(llm) -> list[int]:
    """Wrap `llm.tokenizer` so every call records its text's length; the list of lengths, growing as it is called."""
    calls: list[int] = []
    real = llm.tokenizer

    class Counting:
        def __call__(self, text, **kw):
            calls.append(len(text))
            return real(text, **kw)

        def __getattr__(self, name):
            return getattr(real, name)

    llm.tokenizer = Counting()
    return calls


# two tools and a question for the tool-calling tests over HTTP
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 16},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "required": ["zone"], "additionalProperties": False,
                                       "properties": {"zone": {"type": "string", "maxLength": 8}}}}}
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]
