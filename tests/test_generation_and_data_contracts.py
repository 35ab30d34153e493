"""Contracts a fifth mutation run found unpinned: GPTConfig's refusals, the KV cache and generation
outside the mask, the attention module's head bookkeeping, the process-group set-up of
training/distributed.py (without a real process group), and the tokenizer, corpus and text sources.
Each docstring names the single-line change to the code it was shown to catch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from data import CharTokenizer, eval_windows, load_source
from model import GPT, GPTConfig
from model.attention import CausalSelfAttention, KVCache, additive_mask, causal_mask
from training.visualize import attention_maps

# --- GPTConfig -------------------------------------------------------------------------------------

def tiny(**kw) -> GPTConfig:
    return GPTConfig(**{**dict(vocab_size=11, block_size=12, n_layer=2, n_head=2, n_embd=16), **kw})


@pytest.mark.parametrize("kwargs, message, neighbour", [
    # bool is an int subclass: True would build a one-layer model from a mistyped config
    (dict(n_layer=True), "GPTConfig.n_layer must be a positive integer, got True", dict(n_layer=1)),
    # remainder 1, the case a `% n_head > 1` test lets through
    (dict(n_embd=17), "GPTConfig.n_embd=17 must be divisible by n_head=2", dict(n_embd=18)),
    (dict(dropout=-0.1), r"GPTConfig.dropout must be in \[0, 1\), got -0.1", dict(dropout=0.0)),
    (dict(pos_emb="alibi"), r"GPTConfig.pos_emb='alibi' is unknown; choose one of \('learned', 'rope'\)",
     dict(pos_emb="rope")),
    # rotary positions rotate channel pairs: a head width of 3 has none for its last channel
    (dict(n_embd=6, pos_emb="rope"), "pos_emb='rope' needs an even head width, got n_embd // n_head = 3",
     dict(n_embd=8, pos_emb="rope")),
])
def test_each_model_config_refusal_names_the_field_and_value(kwargs, message, neighbour):
    """Catches (bool accepted as a size), (`n_embd % n_head > 1`), (`not dropout < 1.0`: negative
    dropout accepted), (pos_emb left out of the choices loop), (the even-head-width check dropped)."""
    with pytest.raises(ValueError, match=message):
        tiny(**kwargs)
    GPT(tiny(**neighbour))  # the nearest valid value builds a model


def test_a_rotary_model_cast_with_to_dtype_keeps_its_positions():
    """Module.to(dtype) casts complex buffers to the real dtype, dropping the imaginary part: a rotary
    table kept as a buffer turned into cosines only, and the cast model computed another function
    (3.2 apart in the logits here). .double() leaves complex tensors alone: it is the reference."""
    torch.manual_seed(0)
    model = GPT(tiny(pos_emb="rope")).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    x = torch.randint(0, 11, (2, 12))
    cast = GPT(model.config).eval()
    cast.load_state_dict(model.state_dict())
    reference, cast = model.double(), cast.to(torch.float64)
    torch.testing.assert_close(cast(x)[0], reference(x)[0], rtol=0, atol=0)
    assert (reference(x)[0] - GPT(tiny()).double().eval()(x)[0]).abs().max() > 0.1  # the logits are not trivial


def test_a_cached_forward_past_block_size_names_the_total_length():
    """Catches (forward's check `start + T > block_size` -> `T > block_size`: the cached positions
    forgotten, so the position table is indexed past its end with an IndexError)."""
    model = GPT(tiny()).eval()
    cache = model.new_cache(1)
    model(torch.zeros(1, 8, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="sequence length 13 exceeds block_size 12"):
        model(torch.zeros(1, 5, dtype=torch.long), cache=cache)
    model(torch.zeros(1, 4, dtype=torch.long), cache=cache)  # exactly block_size in all still fits
    assert cache.length == 12


@pytest.mark.parametrize("use_cache, fed", [(False, [3, 4, 5, 6]), (True, [3, 1, 1, 1])])
def test_generate_without_the_cache_feeds_the_whole_window_to_every_forward(use_cache, fed):
    """Cached and uncached generation draw the same tokens by design, so the KV-cache parity checks
    are only informative if use_cache=False really recomputes. Catches (generate passing
    use_cache=True to stream whatever it was given: the parity checks compared the cache with itself)."""
    model = GPT(tiny()).eval()
    seen = []
    model.register_forward_pre_hook(lambda _m, args: seen.append(args[0].size(1)))
    model.generate(torch.zeros(1, 3, dtype=torch.long), 4, use_cache=use_cache)
    assert seen == fed


def test_the_kv_cache_refuses_to_store_past_its_length_and_returns_the_whole_history():
    """Catches (the bound check `end > max_len` loosened by one: a shape error from deep inside the
    slice assignment instead of a message)."""
    cache = KVCache(1, 1, 1, 4, 2, "cpu", torch.float64)
    first = torch.arange(6, dtype=torch.float64).view(1, 1, 3, 2)
    cache.append(0, first, -first)
    cache.length = 3  # what GPT.hidden does once every layer has appended
    k, v = cache.append(0, first[:, :, :1] + 10, -first[:, :, :1] - 10)  # the 4th position: fits
    assert torch.equal(k[0, 0, :, 0], torch.tensor([0.0, 2, 4, 10])) and torch.equal(v, -k)
    with pytest.raises(ValueError, match="KV cache holds 4 positions, asked to store up to 5"):
        cache.append(0, first[:, :, :2], first[:, :, :2])


# --- the attention module's bookkeeping ----------------------------------------------------------

def attention_by_hand(attn: CausalSelfAttention, x: torch.Tensor, qk_norm: bool) -> torch.Tensor:
    """The documented layout, from the weights: qkv's output rows are [q | k | v], each C wide; head h
    owns channels h*D .. (h+1)*D of each; heads merge back in the same order; then proj."""
    B, T, C = x.shape
    H = attn.n_head
    D = C // H
    qkv = x @ attn.qkv.weight.T + attn.qkv.bias  # (B, T, 3C)
    q, k, v = (qkv[..., i * C:(i + 1) * C].reshape(B, T, H, D).transpose(1, 2) for i in range(3))  # (B, H, T, D)
    if qk_norm:
        q, k = (t / t.pow(2).mean(-1, keepdim=True).sqrt() for t in (q, k))
    scores = (q @ k.transpose(-2, -1) / D ** 0.5).masked_fill(~torch.ones(T, T).tril().bool(), float("-inf"))
    y = torch.softmax(scores, dim=-1) @ v  # (B, H, T, D)
    return y.transpose(1, 2).reshape(B, T, C) @ attn.proj.weight.T + attn.proj.bias


@pytest.mark.parametrize("backend", ["manual", "sdpa"])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_attention_module_equals_the_documented_computation_from_its_weights(backend, qk_norm):
    """Relational checks (causality, cache parity, manual vs sdpa) all pass for another function of
    the same weights; a checkpoint would then silently score differently. In eval mode, so a dropout
    of 0.5 must not act. Catches (qkv viewed (B, T, H, 3, D): head-major layout), (q and k swapped),
    (qk_norm giving k = rms_norm(q)), (qk_norm on q only), (`if not self.qk_norm`), (proj skipped),
    (attention dropout also in eval mode)."""
    torch.manual_seed(0)
    attn = CausalSelfAttention(16, 2, 0.5, True, backend, qk_norm, 0).double().eval()
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0, 0.5)
        x = torch.randn(2, 5, 16, dtype=torch.float64)
        got = attn(x, additive_mask(causal_mask(5, 5), torch.float64))
        torch.testing.assert_close(got, attention_by_hand(attn, x, qk_norm), rtol=0, atol=1e-12)
        # positive control: the by-hand reference tells the two qk_norm settings apart
        assert (attention_by_hand(attn, x, not qk_norm) - got).abs().max() > 1e-3


def test_training_mode_drops_whole_output_entries_and_eval_mode_none():
    """The residual dropout zeroes entries of the projected output (with biases, nothing else can
    make one exactly 0). Catches (resid_dropout skipped)."""
    torch.manual_seed(0)
    attn = CausalSelfAttention(16, 2, 0.5, True, "manual", False, 0)
    mask = additive_mask(causal_mask(8, 8))
    with torch.no_grad():
        attn.proj.bias.fill_(1.0)
        x = torch.randn(4, 8, 16)
        zeros = (attn.train()(x, mask) == 0).float().mean().item()
        assert 0.4 < zeros < 0.6
        assert (attn.eval()(x, mask) == 0).sum().item() == 0


def test_attention_maps_come_from_the_manual_path_on_an_sdpa_model_too():
    """Catches (the sdpa branch taken even when weights are asked for: no maps at all)."""
    torch.manual_seed(0)
    manual = GPT(tiny()).eval()
    fused = GPT(tiny(attn_backend="sdpa")).eval()
    fused.load_state_dict(manual.state_dict())
    idx = torch.randint(11, (2, 7))
    maps = attention_maps(fused, idx)
    assert len(maps) == 2 and maps[0].shape == (2, 2, 7, 7)
    assert all(block.attn.weights is None and not block.attn.keep_weights for block in fused.blocks)  # reset
    for got, want in zip(maps, attention_maps(manual, idx), strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rope_rotates_half_precision_in_float32_and_hands_back_the_input_dtype(dtype):
    """What a bf16 autocast forward feeds it: complex numbers need float32, and q, k and v must keep one
    dtype for the attention matmuls. Catches (no upcast: view_as_complex refuses bfloat16), (the
    result left in float32)."""
    from model.attention import apply_rope
    from model.gpt import rope_frequencies

    x = torch.randn(2, 2, 6, 8, generator=torch.Generator().manual_seed(0)).to(dtype)
    out = apply_rope(x, rope_frequencies(6, 8))
    assert out.dtype == dtype
    assert torch.equal(out, apply_rope(x.float(), rope_frequencies(6, 8)).to(dtype))
    assert not torch.equal(out, x)


# --- training/distributed.py without a process group ------------------------------------------------

TORCHRUN = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4"}  # the second process of a second node


@pytest.fixture
def fake_group(monkeypatch):
    """Record the process-group calls instead of making them; pretend resolve_device found `device`."""
    import torch.distributed as dist

    from training import distributed

    calls: list[tuple] = []
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: calls.append(("init", kw)))
    monkeypatch.setattr(dist, "barrier", lambda: calls.append(("barrier",)))
    monkeypatch.setattr(dist, "destroy_process_group", lambda: calls.append(("destroy",)))
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))

    def use(device: str):
        monkeypatch.setattr(distributed, "resolve_device", lambda name: torch.device(device))
        return calls

    return use


def test_torchrun_rank_and_local_rank_come_from_their_own_variables_on_a_cpu(fake_group):
    """Rank 3 of 4 is local rank 1 on a second node; a one-node test cannot tell them apart.
    Catches (LAUNCH_VARS reordered so RANK and LOCAL_RANK swap)."""
    from training.distributed import Dist, init_distributed

    calls = fake_group("cpu")
    got = init_distributed(TORCHRUN, "cpu")
    assert got == Dist(rank=3, local_rank=1, world_size=4, device=torch.device("cpu"), enabled=True)
    assert calls == [("init", {"backend": "gloo"})]


def test_under_torchrun_each_cuda_process_takes_cuda_local_rank_with_nccl(fake_group):
    """Catches (`torch.device("cuda", local_rank)` -> cuda:0 for every rank), (backend always gloo)."""
    from training.distributed import init_distributed

    calls = fake_group("cuda")
    got = init_distributed(TORCHRUN, "cuda")
    cuda1 = torch.device("cuda", 1)
    assert (got.rank, got.local_rank, got.device, got.enabled) == (3, 1, cuda1, True)
    assert calls == [("set_device", cuda1), ("init", {"backend": "nccl", "device_id": cuda1})]


def test_under_torchrun_a_local_rank_without_its_gpu_or_a_fixed_cuda_index_is_refused(fake_group):
    """Catches (`local_rank >= device_count()` -> `>`), (the cuda:N refusal dropped)."""
    from training.distributed import init_distributed

    calls = fake_group("cuda")
    with pytest.raises(ValueError, match="LOCAL_RANK=2 but this machine has 2 CUDA devices"):
        init_distributed({**TORCHRUN, "LOCAL_RANK": "2"}, "cuda")
    with pytest.raises(ValueError, match="under torchrun each process uses cuda:LOCAL_RANK; pass --device=cuda"):
        init_distributed(TORCHRUN, "cuda:0")
    assert calls == []  # refused before any process group exists


def test_under_torchrun_auto_falls_back_from_mps_to_the_cpu_and_explicit_mps_is_refused(fake_group):
    """Catches (`device_name != "auto"` -> `==`)."""
    from training.distributed import init_distributed

    calls = fake_group("mps")
    assert init_distributed(TORCHRUN, "auto").device == torch.device("cpu")
    assert calls == [("init", {"backend": "gloo"})]
    with pytest.raises(ValueError, match="device='mps' cannot run distributed"):
        init_distributed(TORCHRUN, "mps")


def test_rank_zero_runs_the_body_first_and_the_others_wait_for_it(fake_group):
    """Rank 0 fills the encoded cache, then the barrier lets the others read it.
    Catches (the two barriers' rank tests swapped: every rank encodes the corpus at once)."""
    from training.distributed import Dist

    calls = fake_group("cpu")
    for rank, expected in ((0, ["body", "barrier"]), (1, ["barrier", "body"]), (2, ["barrier", "body"])):
        calls.clear()
        with Dist(rank=rank, world_size=3, enabled=True).rank_zero_first():
            calls.append(("body",))
        assert [c[0] for c in calls] == expected, rank
    calls.clear()
    with Dist().rank_zero_first():  # a plain run: no barrier at all
        calls.append(("body",))
    assert calls == [("body",)]


def test_close_leaves_a_process_group_this_run_did_not_create(fake_group):
    """Catches (`dist_info.enabled and` dropped: a plain run inside a caller's process group tore the
    caller's group down)."""
    from training.distributed import Dist, close_distributed

    calls = fake_group("cpu")
    close_distributed(Dist())
    assert calls == []
    close_distributed(Dist(rank=1, world_size=2, enabled=True))
    assert calls == [("destroy",)]


def test_ddp_gets_device_ids_only_on_cuda(monkeypatch):
    """Catches (device_ids always None: DDP on a GPU then has to guess the device)."""
    import torch.nn.parallel

    from training.distributed import Dist

    seen = []
    monkeypatch.setattr(torch.nn.parallel, "DistributedDataParallel",
                        lambda module, device_ids: seen.append(device_ids) or module)
    module = torch.nn.Linear(2, 2)
    assert Dist().wrap(module) is module and seen == []  # not distributed: no wrapper at all
    Dist(device=torch.device("cuda", 1), enabled=True).wrap(module)
    Dist(enabled=True).wrap(module)
    assert seen == [[1], None]


def test_each_rank_and_restart_step_gets_its_own_seed():
    """seed itself on rank 0 of a fresh run; seed + rank + world_size * step otherwise, which no other
    (rank, step) of the same job shares. Catches (seed ignoring the restart step), (local_rank for
    rank: ranks 1 and 3 of two 2-GPU nodes drew the same batches), (step not scaled by world_size)."""
    from training.distributed import Dist

    assert Dist().seed(100) == 100
    assert Dist(rank=3, local_rank=1, world_size=4).seed(100) == 103
    assert Dist(rank=3, local_rank=1, world_size=4).seed(100, step=10) == 143
    seeds = [Dist(rank=r, world_size=4).seed(100, s) for r in range(4) for s in range(50)]
    assert len(set(seeds)) == len(seeds)


# --- tokenizer, corpus, sources ----------------------------------------------------------------

@pytest.mark.parametrize("chars, message", [
    (["a", ""], "CharTokenizer needs single characters"),  # "" would decode to nothing
    ([], "CharTokenizer vocabulary is empty"),
])
def test_a_vocabulary_entry_that_is_not_one_character_or_an_empty_vocabulary_is_refused(chars, message):
    """Catches (`len(c) != 1` -> `len(c) > 1`), (the empty-vocabulary check dropped)."""
    with pytest.raises(ValueError, match=message):
        CharTokenizer(chars)
    with pytest.raises(ValueError, match=message):
        CharTokenizer.from_dict({"chars": chars})  # what a checkpoint's vocab goes through
    assert CharTokenizer(["a", "b"]).vocab_size == 2


def test_a_vocabulary_dict_must_hold_a_list():
    """A string would pass as a sequence of characters. Catches (from_dict checking only that the key
    exists)."""
    with pytest.raises(ValueError, match="a tokenizer dict needs a 'chars' list"):
        CharTokenizer.from_dict({"chars": "ab"})
    assert CharTokenizer.from_dict({"chars": ["a", "b"]}) == CharTokenizer("ab")


def test_tokenizers_with_the_same_characters_in_another_order_differ():
    """The ids differ, so a checkpoint trained with one must not resume with the other.
    Catches (__eq__ comparing sets of characters)."""
    assert CharTokenizer("ab") != CharTokenizer("ba")
    assert CharTokenizer("ab") == CharTokenizer(["a", "b"])


def test_encoding_the_empty_string_gives_no_ids():
    """Catches (codes.max() without initial=0: an empty array has no maximum)."""
    tok = CharTokenizer.from_text("abc")
    assert tok.encode("") == [] and tok.decode([]) == ""
    out = tok.encode_array("")
    assert out.shape == (0,) and out.dtype == np.uint16


@pytest.mark.parametrize("val_len, suggestion", [(5, "--block_size=4 or less"), (2, "--block_size=1 or less"),
                                                 (1, "a smaller block_size")])
def test_a_split_too_short_suggests_the_largest_block_size_that_fits(val_len, suggestion):
    """A split of n tokens holds windows of block_size n - 1. Catches (`fits = min(...) - 1` -> `min(...)`),
    (`fits >= 1` -> `fits > 1`)."""
    from data import Corpus, check_split_sizes

    tok = CharTokenizer("ab")
    corpus = Corpus(np.zeros(40, np.uint16), np.zeros(val_len, np.uint16), tok, "x")
    with pytest.raises(ValueError, match=f"Use a longer corpus .* or {suggestion}$"):
        check_split_sizes(corpus, 16)
    if val_len > 1:
        check_split_sizes(corpus, val_len - 1)  # the suggestion fits


@pytest.mark.parametrize("n, expected", [(12, [(0, 5), (5, 5), (10, 1)]), (11, [(0, 5), (5, 5)])])
def test_eval_windows_keep_a_last_window_of_one_target(n, expected):
    """Catches (range(0, n_targets - 1, block_size): a last window of one target was skipped, so the
    exact val loss missed the final token)."""
    assert eval_windows(np.arange(n), 5) == expected


def test_a_txt_folder_inside_a_hidden_folder_is_still_read(tmp_path):
    """Only names below the folder count as hidden: ~/.local/corpus or a checkout under .cache is
    a normal place to keep text. Catches (the hidden-name test run on the absolute path)."""
    folder = tmp_path / ".cache" / "texts"
    (folder / ".ipynb_checkpoints").mkdir(parents=True)
    (folder / "a.txt").write_text("real text\n", encoding="utf-8")
    (folder / ".ipynb_checkpoints" / "a-checkpoint.txt").write_text("stale draft\n", encoding="utf-8")
    assert load_source(str(folder), tmp_path).text == "real text\n"
