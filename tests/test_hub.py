"""Push / load round trip through a loopback stand-in for the Hub (tests/hub_server.py).

The real huggingface_hub client talks HTTP to the stand-in; loading is checked in fresh processes
that never import hf_lookaround (remote code), online and then offline from the cache, and in a
process with the package (no trust_remote_code). See docs/hub.md for what the stand-in does not cover.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from hub_server import HubServer

from hf_lookaround import cli
from hf_lookaround.cli import push as push_command
from hf_lookaround.hub import cards, load, push
from hf_lookaround.models.lookaround.configuration_lookaround import LookAroundConfig
from hf_lookaround.models.lookaround.modeling_lookaround import LookAroundForPreTraining
from hf_lookaround.objectives import make_plan
from hf_lookaround.data.tokenization import train_tokenizer
from conftest import HUNG_CHILD_SECONDS  # a guard against a hung child, not a speed test

SRC = Path(__file__).resolve().parents[1] / "src"
REPO = "lab/tiny-lookaround"
TEXTS = ["the state of the union is strong", "we the people of the united states", "in order to form a more perfect union",
         "the economy grew and the people prospered", "a nation of laws and of people"] * 4

# every head, by Auto class; the classifier's score layer is new (not in a pretraining checkpoint)
HEAD_CLASSES = ["AutoModel", "AutoModelForPreTraining", "AutoModelForMaskedLM", "AutoModelForCausalLM",
                "AutoModelForSequenceClassification"]


def tree_hashes(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def head_outputs(model_cls_getter, repo, inputs, **kwargs) -> dict[str, torch.Tensor]:
    """Outputs of every head on `inputs`: logits, or last hidden state where the head has no fixed weights."""
    out = {}
    for name in HEAD_CLASSES:
        model = model_cls_getter(name).from_pretrained(repo, **kwargs).eval()
        with torch.no_grad():
            if name == "AutoModel":
                out[name] = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).last_hidden_state
            elif name == "AutoModelForPreTraining":
                out[name] = model(**inputs).logits
            elif name == "AutoModelForSequenceClassification":
                out[name] = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                                  output_hidden_states=True).hidden_states[-1]
            else:
                out[name] = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
        out[name + ".module"] = type(model).__module__
    return out


# The script run in fresh processes. `sys.modules["hf_lookaround"] = None` makes any import of the
# package fail, so the "without the package" half proves the remote code is self-contained.
CHILD = textwrap.dedent('''
    import sys, torch
    sys.modules["hf_lookaround"] = None
    import transformers
    from transformers import AutoTokenizer
    repo, workdir, with_package = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
    inputs = torch.load(workdir + "/inputs.pt")
    result = head_outputs(lambda n: getattr(transformers, n), repo, inputs, trust_remote_code=True)
    tok = AutoTokenizer.from_pretrained(repo, trust_remote_code=True)  # else it asks: the config is remote code
    result["token_ids"] = tok("the people of the union")["input_ids"]
    if with_package:  # then the same process imports the package and loads without the flag
        del sys.modules["hf_lookaround"]
        sys.path.insert(0, sys.argv[4])
        import hf_lookaround
        from hf_lookaround.hub.load import load_pretrained
        plain = head_outputs(lambda n: getattr(transformers, n), repo, inputs)
        result.update({"package." + k: v for k, v in plain.items()})
        checked = load_pretrained(repo, head="causal-lm").eval()
        with torch.no_grad():
            result["package.load_pretrained"] = checked(input_ids=inputs["input_ids"],
                                                        attention_mask=inputs["attention_mask"]).logits
    torch.save(result, workdir + "/out.pt")
''')
# the child runs the same head_outputs as the test (this module imports hf_lookaround, so it cannot import it)
CHILD = f"import torch\nHEAD_CLASSES = {HEAD_CLASSES!r}\n" + inspect.getsource(head_outputs) + CHILD


def run_child(hub_url: str, workdir: Path, hf_home: Path, offline: bool, with_package: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRANSFORMERS_OFFLINE", "HF_TOKEN")}
    env.update(HF_ENDPOINT=hub_url, HF_HOME=str(hf_home), HF_HUB_OFFLINE="1" if offline else "0",
               HF_HUB_DISABLE_PROGRESS_BARS="1", HF_HUB_DISABLE_TELEMETRY="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, REPO, str(workdir), "1" if with_package else "0", str(SRC)],
        env=env, cwd=workdir, capture_output=True, text=True, timeout=HUNG_CHILD_SECONDS, stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Do you wish to run the custom code" not in proc.stdout + proc.stderr
    return torch.load(workdir / "out.pt")


@pytest.fixture(scope="module")
def server():
    with HubServer() as hub:
        yield hub


@pytest.fixture
def online(server, monkeypatch):
    """Point this process's huggingface_hub at the stand-in (it read HF_ENDPOINT / HF_HUB_OFFLINE at import)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", server.url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", server.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    return server


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny DAR-pretrained checkpoint as save_pretrained writes it, with a tokenizer, results and Trainer state."""
    folder = tmp_path_factory.mktemp("ckpt")
    tok = train_tokenizer(TEXTS, vocab_size=300, min_frequency=1, output_dir=str(folder))
    config = LookAroundConfig.from_preset(
        "tiny", vocab_size=len(tok), hidden_size=32, intermediate_size=64, max_position_embeddings=64,
        objective="dar", plan_params={"t": 2}, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, mask_token_id=tok.mask_token_id,
    )
    torch.manual_seed(0)
    LookAroundForPreTraining(config).save_pretrained(folder)
    (folder / "optimizer.pt").write_bytes(b"\0" * 1000)  # Trainer state: must not be uploaded
    (folder / "all_results.json").write_text(json.dumps({"eval_loss": 5.25, "eval_runtime": 1.0, "epoch": 1.0}))
    (folder / "probe_results.json").write_text(
        json.dumps({"task": "trec", "dataset": "trec", "metric": "accuracy", "test_accuracy": 0.5}))
    cards.write_model_card(folder, dataset="sotu")

    batch = tok(["the people of the union", "a nation"], return_tensors="pt", padding=True)
    plan = make_plan("dar", batch["attention_mask"].sum(-1), batch["input_ids"].shape[1],
                     generator=torch.Generator().manual_seed(0), num_condition_tokens=1, t=2)
    inputs = dict(batch, group_ids=plan.group_ids, labels=batch["input_ids"].masked_fill(~plan.is_target, -100))
    torch.save(inputs, folder.parent / "inputs.pt")
    return folder


def test_push_and_load_round_trip(server, online, checkpoint, tmp_path):
    before = tree_hashes(checkpoint)
    local_config = json.loads((checkpoint / "config.json").read_text())
    assert set(local_config["auto_map"]) == {"AutoConfig", "AutoModelForPreTraining"}  # what save_pretrained wrote

    # 1. push with the real client, through the CLI entry point
    assert push_command.main([str(checkpoint), REPO, "--token", "hf_test_token", "--commit-message", "first"]) == 0
    assert tree_hashes(checkpoint) == before, "push must not modify the local checkpoint"
    repo = server.repo(REPO)
    files = repo.files("main")
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json", "README.md",
                 "configuration_lookaround.py", "modeling_lookaround.py", "all_results.json"):
        assert name in files, f"{name} was not uploaded"
    assert "optimizer.pt" not in files
    assert files["model.safetensors"] == (checkpoint / "model.safetensors").read_bytes()
    assert repo.commit_messages[repo.branches["main"]] == "first"
    assert "Bearer hf_test_token" in server.auth_headers
    # the Hub's config has the full auto_map; the README was re-rendered with the repo id
    auto_map = json.loads(files["config.json"])["auto_map"]
    assert set(auto_map) == {"AutoConfig", *HEAD_CLASSES}
    readme = files["README.md"].decode()
    assert f'from_pretrained("{REPO}", trust_remote_code=True)' in readme
    assert "<namespace>/<model-name>" not in readme and "name: lab/tiny-lookaround" in readme

    # reference outputs: the package's classes on the local folder
    inputs = torch.load(checkpoint.parent / "inputs.pt")
    import transformers
    reference = head_outputs(lambda n: getattr(transformers, n), str(checkpoint), inputs)
    assert reference["AutoModelForPreTraining.module"] == "hf_lookaround.models.lookaround.modeling_lookaround"

    # 2. a fresh process without the package, online, with trust_remote_code
    workdir, hf_home = checkpoint.parent, tmp_path / "hf_home"
    remote = run_child(server.url, workdir, hf_home, offline=False, with_package=False)
    # 3. again offline, from that cache: first without the package, then with it and without the flag
    n_requests = len(server.requests)
    offline = run_child(server.url, workdir, hf_home, offline=True, with_package=True)
    assert len(server.requests) == n_requests, "the offline process reached the server"

    tok_ids = transformers.AutoTokenizer.from_pretrained(str(checkpoint))("the people of the union")["input_ids"]
    for result in (remote, offline):
        assert result["token_ids"] == tok_ids
        for name in HEAD_CLASSES:
            assert result[name + ".module"].startswith("transformers_modules."), result[name + ".module"]
            assert torch.equal(result[name], reference[name]), f"{name}: outputs differ after the round trip"
    for name in HEAD_CLASSES:
        assert offline[f"package.{name}.module"] == "hf_lookaround.models.lookaround.modeling_lookaround"
        assert torch.equal(offline[f"package.{name}"], reference[name])
    assert torch.equal(offline["package.load_pretrained"], reference["AutoModelForCausalLM"])

    # pushing the same checkpoint again commits nothing: every file is unchanged
    head = repo.branches["main"]
    push.push_checkpoint(checkpoint, REPO)
    assert repo.branches["main"] == head


def test_failed_push_is_clear_and_leaves_checkpoint_intact(server, online, checkpoint, monkeypatch, capsys):
    import huggingface_hub.utils._http as http

    monkeypatch.setattr(http.time, "sleep", lambda s: None)  # the client retries 5xx with backoff
    before = tree_hashes(checkpoint)
    server.fail_commits = 100
    try:
        with pytest.raises(push.HubPushError) as err:
            push.push_checkpoint(checkpoint, "lab/failing")
        message = str(err.value)
        assert "lab/failing" in message and "500" in message and "not modified" in message
        # the CLI's one-line error form, exit status 2
        assert cli.main(["push", str(checkpoint), "lab/failing"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("hf-lookaround push: error: pushing"), err
    finally:
        server.fail_commits = 0
    assert server.requests.count(("POST", "/api/models/lab/failing/commit/main")) >= 2  # retried, then gave up
    assert tree_hashes(checkpoint) == before
    repo = server.repo("lab/failing")
    assert set(repo.files("main")) == {".gitattributes"}  # nothing half-committed
    # once the server is back, the same push goes through
    push.push_checkpoint(checkpoint, "lab/failing")
    assert "model.safetensors" in repo.files("main")


def test_broken_weights_give_a_clear_error(server, online, checkpoint, tmp_path):
    push.push_checkpoint(checkpoint, "lab/broken", private=True)
    assert server.repo("lab/broken").private
    weights = (checkpoint / "model.safetensors").read_bytes()
    cache = str(tmp_path / "cache")

    server.commit_files("lab/broken", {"model.safetensors": weights[: len(weights) // 2]})
    with pytest.raises(ValueError, match=r"model\.safetensors in the Hub repo lab/broken .*not a valid safetensors"):
        load.load_pretrained("lab/broken", head="causal-lm", cache_dir=cache)

    server.commit_files("lab/broken", {}, deletions=["model.safetensors"])
    with pytest.raises(ValueError, match=r"no weights in the Hub repo lab/broken.*hf-lookaround push"):
        load.load_pretrained("lab/broken", head="causal-lm", cache_dir=cache)

    # a broken local checkpoint is refused before anything is sent
    local = tmp_path / "local"
    local.mkdir()
    (local / "config.json").write_text((checkpoint / "config.json").read_text())
    (local / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage")
    n = len(server.requests)
    with pytest.raises(ValueError, match=r"model\.safetensors in .*local is not a valid safetensors"):
        push.push_checkpoint(local, "lab/never")
    assert len(server.requests) == n
    with pytest.raises(ValueError, match="unknown head"):
        load.load_pretrained(str(checkpoint), head="decoder")


def test_push_requires_network_mode(checkpoint, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(push.HubPushError, match="HF_HUB_OFFLINE"):
        push.push_checkpoint(checkpoint, "lab/offline")
    with pytest.raises(ValueError, match="no config.json"):
        push.push_checkpoint(checkpoint.parent, "lab/offline")


def test_push_trainer_output_uses_the_trainer_hub_arguments(server, online, checkpoint, tmp_path):
    from transformers import Trainer, TrainingArguments

    model = LookAroundForPreTraining.from_pretrained(checkpoint)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), hub_model_id="lab/from-trainer", hub_private_repo=True,
                             hub_token="hf_trainer_token", report_to=[])
    push.push_trainer_output(Trainer(model=model, args=args), dataset="sotu")
    repo = server.repo("lab/from-trainer")
    assert repo.private and server.auth_headers[-1] == "Bearer hf_trainer_token"
    files = repo.files("main")
    assert files["model.safetensors"] == (tmp_path / "out" / "model.safetensors").read_bytes()
    card = files["README.md"].decode()
    assert "objective (`dar`)" in card and 'from_pretrained("lab/from-trainer"' in card and "\nsotu." in card


VISION_CHILD = textwrap.dedent('''
    import sys, torch
    sys.modules["hf_lookaround"] = None  # prove the remote code is self-contained
    import transformers
    repo, workdir = sys.argv[1], sys.argv[2]
    io = torch.load(workdir + "/vision_io.pt")
    out = {}
    for name in ("AutoModel", "AutoModelForPreTraining", "AutoModelForImageClassification"):
        model = getattr(transformers, name).from_pretrained(repo, trust_remote_code=True).eval()
        with torch.no_grad():
            if name == "AutoModelForPreTraining":
                out[name] = model(pixel_values=io["pixels"], group_ids=io["group_ids"],
                                  target_positions=io["targets"]).logits
            elif name == "AutoModel":
                out[name] = model(pixel_values=io["pixels"]).last_hidden_state
            else:
                out[name] = model(pixel_values=io["pixels"]).logits.shape
        out[name + ".module"] = type(model).__module__
    torch.save(out, workdir + "/vision_out.pt")
''')


def test_vision_checkpoint_push_and_remote_load(server, online, tmp_path):
    """A two-stream ViT checkpoint goes through the same push path and loads without the package."""
    from hf_lookaround import LookAroundViTConfig, LookAroundViTForPreTraining

    torch.manual_seed(0)
    config = LookAroundViTConfig(image_size=28, patch_size=7, num_channels=1, hidden_size=32, num_hidden_layers=2,
                                 num_attention_heads=2, intermediate_size=64, objective="gvp",
                                 plan_params={"num_groups": 4, "segmentation": "mixed"})
    model = LookAroundViTForPreTraining(config).eval()
    folder = tmp_path / "vit"
    model.save_pretrained(folder)
    push.push_checkpoint(folder, "lab/tiny-vit")
    pixels = torch.rand(2, 1, 28, 28)
    plan = make_plan("gvp", [17, 17], 17, num_groups=4, segmentation="mixed", num_condition_tokens=1,
                     generator=torch.Generator().manual_seed(0))
    targets = plan.target_positions()
    with torch.no_grad():
        want = {"AutoModelForPreTraining": model(pixel_values=pixels, group_ids=plan.group_ids,
                                                 target_positions=targets).logits,
                "AutoModel": model.vit(pixel_values=pixels).last_hidden_state}
    torch.save({"pixels": pixels, "group_ids": plan.group_ids, "targets": targets}, tmp_path / "vision_io.pt")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRANSFORMERS_OFFLINE", "HF_TOKEN")}
    env.update(HF_ENDPOINT=server.url, HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="0",
               HF_HUB_DISABLE_PROGRESS_BARS="1", HF_HUB_DISABLE_TELEMETRY="1")
    proc = subprocess.run([sys.executable, "-c", VISION_CHILD, "lab/tiny-vit", str(tmp_path)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=HUNG_CHILD_SECONDS, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = torch.load(tmp_path / "vision_out.pt")
    assert torch.equal(got["AutoModelForPreTraining"], want["AutoModelForPreTraining"])
    assert torch.equal(got["AutoModel"], want["AutoModel"])
    assert tuple(got["AutoModelForImageClassification"]) == (2, config.num_labels)
    assert all(not got[f"{n}.module"].startswith("hf_lookaround") for n in
               ("AutoModel", "AutoModelForPreTraining", "AutoModelForImageClassification"))
