"""Collators: shapes, and above all the distributions the papers prescribe."""

import math

import numpy as np
import pytest
import torch
from scipy import stats

from hf_lookaround.objectives import make_collator, max_targets
from hf_lookaround.objectives.ar import AutoregressiveCollator
from hf_lookaround.objectives.dar import SemiAutoregressiveCollator
from hf_lookaround.objectives.gvp import GVPCollator
from hf_lookaround.objectives.mlm import MaskedCollator
from hf_lookaround.objectives.vmlm import VariableMaskedCollator
from conftest import BOS, EOS, MASK, PAD, ToyTokenizer

VOCAB = 100


class NoMaskTokenizer(ToyTokenizer):
    mask_token_id = None


def docs(batch, length, seed=0):
    """Sequences <s> w ... w </s> of the given lengths (ints) or of one length."""
    g = torch.Generator().manual_seed(seed)
    lengths = [length] * batch if isinstance(length, int) else length
    return [{"input_ids": [BOS] + torch.randint(10, VOCAB, (n - 2,), generator=g).tolist() + [EOS]} for n in lengths]


def test_outputs_padding_and_labels():
    batch = AutoregressiveCollator(ToyTokenizer())(docs(3, [6, 4, 5]))
    assert batch["input_ids"].shape == (3, 6)
    assert batch["attention_mask"].sum(-1).tolist() == [6, 4, 5]
    assert (batch["input_ids"][1, 4:] == PAD).all()
    # BOS is the rank-0 condition token: every real token after it is a target, padding never is
    assert batch["group_ids"][0].tolist() == [0, 1, 2, 3, 4, 5]
    assert (batch["labels"][:, 0] == -100).all() and (batch["labels"][1, 4:] == -100).all()
    assert batch["target_positions"].tolist() == [[1, 2, 3, 4, 5], [1, 2, 3, -1, -1], [1, 2, 3, 4, -1]]
    labelled = batch["labels"] != -100
    assert torch.equal(batch["labels"][labelled], batch["input_ids"][labelled])


def test_static_target_width_and_multiple():
    collator = MaskedCollator(ToyTokenizer(), mask_ratio=0.3, pad_targets_to=max_targets("mlm", 20, mask_ratio=0.3),
                              pad_to_multiple_of=8)
    batch = collator(docs(4, [20, 9, 13, 17]))
    assert batch["input_ids"].shape == (4, 24)
    assert batch["target_positions"].shape == (4, 6)
    for b in range(4):
        pos = batch["target_positions"][b]
        pos = pos[pos >= 0]
        assert torch.equal(pos, (batch["labels"][b] != -100).nonzero().flatten())


def test_masked_never_masks_special_tokens():
    batch = VariableMaskedCollator(ToyTokenizer(), mask_ratio_range=(0.5, 0.9))(docs(64, 12))
    targets = batch["labels"] != -100
    assert not targets[:, 0].any() and not targets[:, -1].any()  # BOS, EOS
    # two-stream form: inputs unchanged, masked tokens get the higher rank
    assert batch["group_ids"][targets].min() > batch["group_ids"][~targets & (batch["attention_mask"] > 0)].max()


def test_variable_mask_ratio_is_uniform_ks():
    a, b = 0.15, 0.3
    n = 1002  # 1000 maskable tokens per sequence: ratio resolution 1e-3
    batch = VariableMaskedCollator(ToyTokenizer(), mask_ratio_range=(a, b), seed=3)(docs(600, n))
    ratios = (batch["labels"] != -100).sum(-1).double().numpy() / (n - 2)
    assert ratios.min() >= a - 1e-3 and ratios.max() <= b + 1e-3
    assert stats.kstest(ratios, "uniform", args=(a, b - a)).pvalue > 0.01
    # and it is not the fixed-ratio collator in disguise
    fixed = MaskedCollator(ToyTokenizer(), mask_ratio=0.15)(docs(50, n))
    assert ((fixed["labels"] != -100).sum(-1) == 150).all()


def test_first_group_sizes_are_uniform_chi2():
    t = 3
    batch = SemiAutoregressiveCollator(ToyTokenizer(), group_size=t, seed=1)(docs(3000, 12))
    s1 = (batch["group_ids"] == 1).sum(-1)  # rank 0 is BOS; the first group has rank 1
    counts = torch.bincount(s1, minlength=t + 1)[1:].numpy()
    assert counts.sum() == 3000
    assert stats.chisquare(counts).pvalue > 0.01
    # later groups have exactly t tokens
    g = batch["group_ids"][0]
    sizes = torch.bincount(g[1:11])[2:]
    assert (sizes[:-1] == t).all()


def test_group_size_mixture_chi2():
    batch = SemiAutoregressiveCollator(ToyTokenizer(), group_size=[2, 4], seed=5)(docs(4000, 14))
    s1 = (batch["group_ids"] == 1).sum(-1)
    counts = torch.bincount(s1, minlength=5)[1:].numpy()
    # t ~ U{2, 4}, then s1 ~ U{1..t}
    expected = 4000 * np.array([1 / 4 + 1 / 8, 1 / 4 + 1 / 8, 1 / 8, 1 / 8])
    assert stats.chisquare(counts, expected).pvalue > 0.01


def test_gvp_mixed_segmentation_follows_the_recipe():
    K, n = 20, 1001  # 1000 positions after BOS
    batch = GVPCollator(ToyTokenizer(), num_groups=K, segmentation="mixed", seed=2)(docs(800, n))
    g = batch["group_ids"][:, 1:] - 1  # undo the BOS shift: groups G0..GK have ranks 0..K
    sizes = torch.stack([torch.bincount(row, minlength=K + 1) for row in g])  # (B, K+1)
    bounds = sizes.cumsum(-1).double()  # n0 < n1 < ... < nK = T
    assert (bounds[:, -1] == n - 1).all()
    p = (bounds[:, K - 1] / (n - 1)).numpy()
    assert abs(p.mean() - 0.5) < 0.015 and abs(p.std() - 0.1) < 0.015
    assert stats.kstest(p, "norm", args=(0.5, 0.1)).pvalue > 0.01
    # inner boundaries n0..n(K-2): uniform on [1, n(K-1) - 1]
    inner = (bounds[:, : K - 1] / bounds[:, K - 1 : K]).flatten().numpy()
    assert stats.kstest(inner, "uniform").pvalue > 0.01
    # G0 is the condition: no loss there; everything else is a target
    assert ((batch["labels"][:, 1:] != -100) == (g >= 1)).all()


def test_gvp_on_patch_features():
    patches = torch.randn(3, 16, 8)
    out = GVPCollator(num_groups=4, segmentation="fixed")(patches)
    assert set(out) == {"pixel_values", "attention_mask", "group_ids", "target_positions", "target_mask"}
    assert torch.equal(out["pixel_values"], patches)
    assert out["group_ids"].max() == 4 and (torch.bincount(out["group_ids"][0]) == torch.tensor([3, 3, 4, 3, 3])).all()  # n_i = round((i+1) 16/5)
    ragged = GVPCollator(num_groups=2)([{"inputs_embeds": torch.randn(5, 4)}, {"inputs_embeds": torch.randn(7, 4)}])
    assert ragged["inputs_embeds"].shape == (2, 7, 4) and ragged["attention_mask"].sum().item() == 12
    assert not ragged["target_mask"][0, 5:].any()


def test_single_stream_form():
    collator = MaskedCollator(ToyTokenizer(), mask_ratio=0.5, form="single_stream", seed=0)
    features = docs(400, 50)
    batch = collator(features)
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    original = collator._pad_tokens(features)[0]
    masked = batch["labels"] != -100
    assert torch.equal(batch["labels"][masked], original[masked])
    assert torch.equal(batch["input_ids"][~masked], original[~masked])
    became_mask = (batch["input_ids"][masked] == MASK).double().mean().item()
    kept = (batch["input_ids"][masked] == original[masked]).double().mean().item()
    assert abs(became_mask - 0.8) < 0.02 and abs(kept - 0.1) < 0.02  # 80/10/10 (random may hit the same id)
    all_mask = MaskedCollator(ToyTokenizer(), mask_ratio=0.5, form="single_stream", mask_replace_prob=1.0,
                              random_replace_prob=0.0)(features)
    assert (all_mask["input_ids"][masked] == MASK).all()


def test_mask_token_required_only_for_single_stream():
    with pytest.raises(ValueError, match="no mask token"):
        MaskedCollator(NoMaskTokenizer(), form="single_stream")
    MaskedCollator(NoMaskTokenizer(), form="two_stream")(docs(2, 8))  # the two-stream form needs none


@pytest.mark.parametrize("bad", [(0.3, 0.15), (0.0, 0.2), (0.2, 1.0), (0.1,), "x"])
def test_invalid_ratio_ranges(bad):
    with pytest.raises(ValueError, match="mask_ratio_range"):
        VariableMaskedCollator(ToyTokenizer(), mask_ratio_range=bad)


def test_invalid_parameters():
    with pytest.raises(ValueError, match="mask_ratio"):
        MaskedCollator(ToyTokenizer(), mask_ratio=1.5)
    with pytest.raises(ValueError, match="group_size"):
        SemiAutoregressiveCollator(ToyTokenizer(), group_size=0)
    with pytest.raises(ValueError, match="unknown objective"):
        make_collator("bert", ToyTokenizer())
    with pytest.raises(ValueError, match="right padding"):
        AutoregressiveCollator(ToyTokenizer())([{"input_ids": [1, 5, 6], "attention_mask": [0, 1, 1]}])


def test_a_batch_plan_does_not_depend_on_history():
    # What resuming needs: Trainer skips seen batches without collating them, so the plan of a
    # batch must not depend on how many batches this collator drew before.
    first, second = docs(4, 32, seed=1), docs(4, 32, seed=2)
    warm = make_collator("vmlm", ToyTokenizer(), seed=0)
    warm(first)
    after = warm(second)
    fresh = make_collator("vmlm", ToyTokenizer(), seed=0)(second)
    assert torch.equal(after["group_ids"], fresh["group_ids"])
    # a new epoch gives the same batch a new plan
    warm.set_epoch(1)
    assert not torch.equal(warm(second)["group_ids"], fresh["group_ids"])
    # the plain stream mode does depend on history
    stream = make_collator("vmlm", ToyTokenizer(), seed=0, per_batch_seed=False)
    stream(first)
    assert not torch.equal(stream(second)["group_ids"], fresh["group_ids"])


@pytest.mark.parametrize("objective", ["ar", "dar", "mlm", "vmlm", "gvp"])
def test_ids_as_lists_arrays_or_tensors_give_the_same_batch(objective):
    # pretraining hands the collator numpy rows (rows_as_numpy); a dataset with no format gives lists
    params = {"gvp": {"num_groups": 4}}.get(objective, {})
    features = docs(6, [32, 20, 32, 7, 32, 25], seed=6)
    lists = make_collator(objective, ToyTokenizer(), seed=2, **params)(features)
    for convert in (np.asarray, torch.tensor):
        other = make_collator(objective, ToyTokenizer(), seed=2, **params)(
            [{"input_ids": convert(f["input_ids"])} for f in features])
        assert lists.keys() == other.keys() and all(torch.equal(lists[k], other[k]) for k in lists)


def test_max_targets_bounds_counts():
    for ratio in (0.15, 0.3, 0.5):
        batch = MaskedCollator(ToyTokenizer(), mask_ratio=ratio)(docs(4, 37))
        assert batch["target_positions"].shape[1] <= max_targets("mlm", 37, mask_ratio=ratio) == math.ceil(ratio * 37)


@pytest.mark.parametrize("objective", ["dar", "mlm", "gvp"])
def test_each_process_rank_draws_its_own_plans(objective, monkeypatch):
    # Ranks of a multi-process run may hold identical content (e.g. repeated text): their masks
    # must still differ, and each rank's plan must be reproducible (what resuming needs).
    params = {"gvp": {"num_groups": 4}}.get(objective, {})
    features = docs(8, 32)
    plans_of = {r: make_collator(objective, ToyTokenizer(), seed=3, process_rank=r, **params)(features)["group_ids"]
                for r in range(4)}
    assert all(not torch.equal(plans_of[a], plans_of[b]) for a in range(4) for b in range(a + 1, 4))
    again = make_collator(objective, ToyTokenizer(), seed=3, process_rank=1, **params)(features)["group_ids"]
    assert torch.equal(again, plans_of[1])
    # without an explicit rank, the process's rank is used ($RANK outside torch.distributed)
    monkeypatch.setenv("RANK", "2")
    assert torch.equal(make_collator(objective, ToyTokenizer(), seed=3, **params)(features)["group_ids"], plans_of[2])
    monkeypatch.delenv("RANK")
    assert torch.equal(make_collator(objective, ToyTokenizer(), seed=3, **params)(features)["group_ids"], plans_of[0])
    # the plain stream mode also gives each rank its own stream
    streams = [make_collator(objective, ToyTokenizer(), seed=3, per_batch_seed=False, process_rank=r,
                             **params)(features)["group_ids"] for r in (0, 1)]
    assert not torch.equal(*streams)


# ------------------------------------------------------------------------------------------ data loader workers
def loader_batches(collator, features, workers, epochs=(0, 1), persistent=False):
    """The batches of a DataLoader over ``features`` (fixed order), epoch by epoch, as Trainer drives it."""
    loader = torch.utils.data.DataLoader(features, batch_size=4, collate_fn=collator, num_workers=workers,
                                         persistent_workers=persistent)
    out = []
    for epoch in epochs:
        collator.set_epoch(epoch)  # CollatorEpochCallback.on_epoch_begin: before the epoch's iterator
        out.append([batch["group_ids"] for batch in loader])
    return out


@pytest.mark.parametrize("objective", ["vmlm", "gvp"])
def test_plans_do_not_depend_on_the_number_of_workers(objective):
    params = {"gvp": {"num_groups": 4}}.get(objective, {})
    features = docs(16, 32, seed=4)
    main = loader_batches(make_collator(objective, ToyTokenizer(), seed=5, **params), features, workers=0)
    assert not torch.equal(main[0][0], main[1][0])  # a new epoch draws new plans
    for workers, persistent in ((2, False), (2, True), (1, True)):
        # persistent workers are created once, in epoch 0, and must still see epoch 1
        other = loader_batches(make_collator(objective, ToyTokenizer(), seed=5, **params), features, workers,
                               persistent=persistent)
        for epoch in (0, 1):
            assert all(torch.equal(a, b) for a, b in zip(main[epoch], other[epoch], strict=True)), (workers, epoch)


def test_pretraining_collates_in_workers_on_a_gpu_only(monkeypatch, tmp_path):
    from hf_lookaround.cli.pretrain import parse_args
    from hf_lookaround.training import pretraining

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert pretraining.default_dataloader_workers(use_cpu=False) == pretraining.GPU_DATALOADER_WORKERS == 2
    assert pretraining.default_dataloader_workers(use_cpu=True) == 0
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pretraining.default_dataloader_workers(use_cpu=False) == 0

    base = ["--train_files", "x.txt", "--output_dir", str(tmp_path), "--do_train"]
    parsed = lambda *extra: parse_args(base + list(extra))  # noqa: E731
    assert parsed()[3].dataloader_num_workers == 0 and parsed()[3].dataloader_workers_by_default
    assert parsed("--dataloader_num_workers", "5")[3].dataloader_num_workers == 5
    assert not parsed("--dataloader_num_workers", "5")[3].dataloader_workers_by_default
    # workers persist between epochs whenever there are any (issue 41: no fork inside the steps at an epoch start)
    assert not parsed()[3].dataloader_persistent_workers
    assert parsed("--dataloader_num_workers", "5")[3].dataloader_persistent_workers
    assert not parsed("--dataloader_num_workers", "5", "--dataloader_persistent_workers", "false")[3] \
        .dataloader_persistent_workers
    # DDP: 100 MB buckets and no buffer broadcast unless asked otherwise
    assert (parsed()[3].ddp_bucket_cap_mb, parsed()[3].ddp_broadcast_buffers) == (100, False)
    assert parsed("--ddp_bucket_cap_mb", "25")[3].ddp_bucket_cap_mb == 25
    # a stream keeps the main process unless workers are asked for: its blocks depend on the number of workers
    stream = ("--streaming", "--max_steps", "2")
    for extra, by_default, expected in (((), True, 0), (("--dataloader_num_workers", "3"), False, 3)):
        _, data_args, _, training_args = parsed(*stream, *extra)
        if by_default:
            training_args.dataloader_num_workers = 2  # what the default gives on a GPU
        pretraining.check_data_args(data_args, training_args)
        assert training_args.dataloader_num_workers == expected
        assert training_args.dataloader_persistent_workers == (expected > 0)
