"""Hugging Face interop (node/stage/hf.py): ``node export --format hf``, ``node generate`` on
such a directory, and ``node join --init hf:DIR``.

Our side is checked against ``transformers`` itself (the optional ``hf`` extra, which CI
installs; without it those tests skip): its ``LlamaForCausalLM`` loads our export and gives
our logits and greedy tokens, and a randomly initialised ``LlamaConfig`` checkpoint (with a
BPE tokenizer trained here by ``tokenizers``, nothing downloaded) gives, split into our
stages, its logits and its loss. The slow test starts a real swarm with ``--init hf:DIR``
and compares its first evaluation with transformers' loss on the same batches.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from node.cli import _parser, join_config, main, with_init_model
from node.config import Config, resolve_config
from node.data.dataset import open_dataset
from node.data.tokenizer import ByteTokenizer, HFTokenizer, save_byte_tokenizer
from node.stage import hf
from node.stage.export import (
    eval_loss,
    export_model,
    generate_ids,
    init_stage,
    load_export,
    load_model,
    stage_slice,
)
from node.stage.model import (
    FullModel,
    ModelConfig,
    build_model,
    build_stage,
    compose_stages,
    model_fingerprint,
)
from tests.helpers import FAST_SWARM, wait_for
from tests.test_export import _config, _fake_swarm, _trained_stages

TEXTS = [
    "Hello, world!",
    "  two spaces, a tab\t and a newline\n",
    "héllo ✓ 日本語 🎉 – “quotes”",
    "\x00\x01\x7f control bytes",
    "def f(x):\n    return x ** 2\n",
]


def _transformers() -> Any:
    return pytest.importorskip("transformers")


def _ids(vocab: int, batch: int, seq_len: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq_len), generator=torch.Generator().manual_seed(seed))


# ---- the byte-level tokenizer as tokenizer.json --------------------------------------------


def test_byte_tokenizer_json_gives_our_ids(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    save_byte_tokenizer(path)
    ours, theirs = ByteTokenizer(), HFTokenizer(str(path))
    assert theirs.vocab_size == 256 and theirs.eos_id is None and theirs.bos_id is None
    for text in TEXTS:
        assert theirs.encode(text) == ours.encode(text), text
        assert theirs.decode(ours.encode(text)) == text
    broken = [0xFF, 0x41, 0xE2, 0x9C]  # not UTF-8: both decode with replacement characters
    assert theirs.decode(broken) == ours.decode(broken)


def test_auto_tokenizer_loads_our_byte_tokenizer(tmp_path: Path, monkeypatch: Any) -> None:
    transformers = _transformers()
    config = _config()
    status, _ = _fake_swarm(config, _trained_stages(config), monkeypatch)
    export_model(status, config, tmp_path / "hf", format="hf")
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    for text in TEXTS:
        assert tok(text).input_ids == ByteTokenizer().encode(text), text
        assert tok.decode(tok(text).input_ids) == text


# ---- export: our model in transformers ---------------------------------------------------


def test_export_hf_logits_equal_ours(tmp_path: Path, monkeypatch: Any) -> None:
    transformers = _transformers()
    config = _config()
    stages = _trained_stages(config)
    status, _ = _fake_swarm(config, stages, monkeypatch)
    info = export_model(status, config, tmp_path / "hf", format="hf")
    assert info.fingerprint == status["fingerprint"]
    names = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert names == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "murmuration.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    ours = compose_stages(stages[0], stages[1:]).eval()  # type: ignore[arg-type]
    assert ours.cfg.embed_norm  # the fold is what is tested
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert theirs.dtype == torch.float32
    worst = 0.0
    with torch.no_grad():
        for seed, (batch, seq_len) in enumerate([(4, 128), (2, 37), (1, 1)]):
            ids = _ids(256, batch, seq_len, seed)
            worst = max(worst, float((theirs(ids).logits - ours(ids)).abs().max()))
    print(f"\nmax |logit difference|, transformers vs ours, fp32: {worst:.2e}")
    assert worst < 1e-4

    # bf16: the same model within bf16 rounding of the weights.
    export_model(status, config, tmp_path / "bf16", format="hf", dtype="bfloat16")
    low = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.float32)
    with safe_open(str(tmp_path / "bf16" / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("lm_head.weight").dtype == torch.bfloat16
    ids = _ids(256, 2, 64, 9)
    with torch.no_grad():
        bf16_gap = float((low(ids).logits - ours(ids)).abs().max())
    print(f"max |logit difference| with bf16 weights: {bf16_gap:.3f}")
    assert 1e-4 < bf16_gap < 0.1


def test_greedy_generate_equals_transformers(tmp_path: Path, monkeypatch: Any, capsys: Any) -> None:
    transformers = _transformers()
    config = _config()
    stages = _trained_stages(config)
    with torch.no_grad():  # further from the init, so greedy tokens vary
        gen = torch.Generator().manual_seed(3)
        for module in stages:
            for p in module.parameters():
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    status, _ = _fake_swarm(config, stages, monkeypatch)
    export_model(status, config, tmp_path / "own")
    export_model(status, config, tmp_path / "hf", format="hf")
    prompt, new = "The swarm ", 100  # 110 tokens: within the 128 positions

    argv = ["generate", "--prompt", prompt, "--temperature", "0", "--max-tokens", str(new)]
    assert main([*argv, "--model", str(tmp_path / "own")]) == 0
    ours_text = capsys.readouterr().out
    assert main([*argv, "--model", str(tmp_path / "hf")]) == 0  # node generate reads both
    assert capsys.readouterr().out == ours_text
    model, _ = load_export(tmp_path / "own")
    ours = generate_ids(model, list(prompt.encode()), max_tokens=new, temperature=0)

    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    theirs_model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = theirs_model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
        )
    theirs = out[0, ids.shape[1] :].tolist()
    matched = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), new)
    print(f"\ngreedy generate: {matched} of {new} tokens equal ({len(set(ours))} distinct)")
    assert theirs == ours and len(set(ours)) > 10
    assert ours_text == prompt + tok.decode(theirs) + "\n"


# ---- init: a Llama checkpoint in the swarm -----------------------------------------------


def _bpe_tokenizer(path: Path) -> int:
    """A byte-level BPE trained here on part of the embedded corpus, with Llama's <s> and
    </s>; its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from node.data.stdlib_corpus import embedded_corpus

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([d.text for d in embedded_corpus()[:400]], trainer)
    tok.save(str(path))
    return int(tok.get_vocab_size())


def llama_checkpoint(
    path: Path, *, seed: int = 0, tied: bool = False, layers: int = 4, **overrides: Any
) -> Path:
    """A small randomly initialised ``LlamaForCausalLM`` saved with ``save_pretrained``, and a
    tokenizer beside it. The weights are drawn wider than transformers' init and the norms
    away from 1, so a swapped or mis-permuted tensor changes the logits a lot."""
    transformers = _transformers()
    path.mkdir(parents=True, exist_ok=True)
    vocab = _bpe_tokenizer(path / "tokenizer.json")
    cfg = transformers.LlamaConfig(
        vocab_size=vocab + 16,  # padded, as real checkpoints often are
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=layers,
        num_attention_heads=4,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_theta=5000.0,
        tie_word_embeddings=tied,
        bos_token_id=0,
        eos_token_id=1,
        **overrides,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(path)
    return path


def _init_config(ckpt: Path, num_block_stages: int = 2, **overrides: Any) -> Config:
    sets = {"node.init_dir": f"hf:{ckpt}", "swarm.num_block_stages": num_block_stages}
    return with_init_model(resolve_config(overrides={**sets, **overrides}))


def _swarm_model(config: Config) -> FullModel:
    """The checkpoint as the swarm's stages hold it, each stage loaded from its own slice."""
    n, cfg = config.swarm.num_block_stages, config.model
    stages = [build_stage(cfg, n, s, config.swarm.seed) for s in range(n + 1)]
    for s, module in enumerate(stages):
        tensors = stage_slice(config.node.init_dir, cfg, n, s)
        module.load_state_dict({k.removeprefix("param."): v for k, v in tensors.items()})
    return compose_stages(stages[0], stages[1:]).eval()  # type: ignore[arg-type]


def transformers_loss(model: Any, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """The mean over batches of transformers' own causal-LM loss (it shifts the labels)."""
    losses = []
    with torch.no_grad():
        for ids, labels in batches:
            row = torch.cat([ids, labels[:, -1:]], dim=1)
            assert torch.equal(row[:, 1:], labels)
            losses.append(float(model(input_ids=row, labels=row).loss))
    return sum(losses) / len(losses)


@pytest.mark.parametrize("tied", [False, True])
def test_init_from_llama_checkpoint(tmp_path: Path, tied: bool) -> None:
    transformers = _transformers()
    ckpt = llama_checkpoint(tmp_path / "llama", tied=tied)
    config = _init_config(ckpt)
    cfg = config.model
    assert (cfg.vocab_size, cfg.d_model, cfg.num_heads, cfg.num_blocks) == (400, 64, 4, 4)
    assert (cfg.ffn_dim, cfg.max_seq_len, cfg.rope_theta, cfg.norm_eps) == (176, 128, 5000.0, 1e-5)
    assert not cfg.embed_norm and len(cfg.checkpoint) == 16
    assert config.data.tokenizer == str((ckpt / "tokenizer.json").resolve())

    ours = _swarm_model(config)
    theirs = transformers.LlamaForCausalLM.from_pretrained(ckpt).eval()
    with torch.no_grad():
        ids = _ids(cfg.vocab_size, 3, 128, 1)
        gap = float((theirs(ids).logits - ours(ids)).abs().max())
        scale = float(ours(ids).std())
    assert gap < 1e-4 and scale > 1.0, (gap, scale)

    # The swarm's data: the checkpoint's tokenizer, batches as a head node cuts them.
    dataset = open_dataset(config.data, shard=0, seed=0, vocab_size=cfg.vocab_size)
    batches = dataset.eval_batches(2, 4, config.data.seq_len)
    assert max(int(ids.max()) for ids, _ in batches) >= 256  # BPE ids, not bytes
    ours_loss, theirs_loss = eval_loss(ours, batches), transformers_loss(theirs, batches)
    print(
        f"\ntied={tied}: max |logit difference| {gap:.1e}; loss ours {ours_loss:.7f}, "
        f"transformers {theirs_loss:.7f}"
    )
    assert ours_loss == pytest.approx(theirs_loss, rel=1e-5)
    assert abs(ours_loss - math.log(cfg.vocab_size)) > 0.5  # far from uniform: a real check


async def test_init_stage_on_a_runner(tmp_path: Path) -> None:
    from node.stage.runner import StageRunner

    ckpt = llama_checkpoint(tmp_path / "llama")
    config = _init_config(ckpt)
    runner = StageRunner(config, 2)
    await runner.start()
    try:
        await runner.compute(init_stage, runner, config.node.init_dir)
        assert runner.step == 0 and not runner.optimizer.state
        with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
            expected = f.get_tensor("model.layers.3.mlp.down_proj.weight")
        assert torch.equal(runner.module.state_dict()["blocks.1.mlp.w2.weight"], expected)
    finally:
        runner.close()


def test_checkpoint_enters_the_fingerprint(tmp_path: Path) -> None:
    a = _init_config(llama_checkpoint(tmp_path / "a", seed=0))
    b = _init_config(llama_checkpoint(tmp_path / "b", seed=1))
    again = _init_config(tmp_path / "a")
    fp = [model_fingerprint(c.model, 2, 0) for c in (a, b, again)]
    assert fp[0] == fp[2] and fp[0] != fp[1]
    assert a.model.checkpoint != b.model.checkpoint
    # join_config resolves the same way from the command line.
    args = _parser().parse_args(
        ["join", "--init", f"hf:{tmp_path / 'a'}", "--set", "swarm.num_block_stages=2"]
    )
    assert join_config(args).model == a.model


def test_init_config_errors(tmp_path: Path) -> None:
    ckpt = llama_checkpoint(tmp_path / "llama", layers=4)
    with pytest.raises(ValueError, match="4 layers cannot be split into 3"):
        _init_config(ckpt, num_block_stages=3)
    with pytest.raises(ValueError, match="drop the model.d_model setting"):
        _init_config(ckpt, **{"model.d_model": 32})
    other = tmp_path / "other.json"
    save_byte_tokenizer(other)
    with pytest.raises(ValueError, match="is not the checkpoint's tokenizer"):
        _init_config(ckpt, **{"data.tokenizer": str(other)})
    with pytest.raises(ValueError, match="data.seq_len 200 exceeds .* 128"):
        _init_config(ckpt, **{"data.seq_len": 200, "swarm.model": "small"})
    with pytest.raises(ValueError, match="directory not found"):
        _init_config(tmp_path / "missing")
    assert main(["join", "--init", f"hf:{tmp_path / 'missing'}", "--set", "node.stage=0"]) == 2


# ---- unsupported checkpoints: refused by name ---------------------------------------------


def _our_checkpoint(path: Path) -> Path:
    """A valid Llama checkpoint written by our own exporter (no transformers needed)."""
    cfg = ModelConfig(d_model=32, num_heads=2, num_blocks=2, ffn_dim=64, max_seq_len=32)
    hf.write_checkpoint(path, cfg, build_model(cfg, seed=0).state_dict())
    return path


def _edit_config(path: Path, **changes: Any) -> None:
    doc = json.loads((path / "config.json").read_text())
    doc.update(changes)
    (path / "config.json").write_text(json.dumps(doc))


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"model_type": "mistral"}, "model_type = 'mistral' is not supported"),
        ({"num_key_value_heads": 1}, "num_key_value_heads = 1 .* grouped-query"),
        ({"attention_bias": True}, "attention_bias = True .* no biases"),
        ({"mlp_bias": True}, "mlp_bias = True"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling = "),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope_parameters.rope_type"),
        ({"hidden_act": "gelu"}, "hidden_act = 'gelu'"),
        ({"head_dim": 8}, "head_dim = 8"),
        ({"hidden_size": None}, "hidden_size missing"),
        ({"num_hidden_layers": 3}, "model.layers.2.input_layernorm.weight is missing"),
        ({"intermediate_size": 48}, r"mlp.gate_proj.weight has shape \(64, 32\), .* \(48, 32\)"),
        (
            {"num_attention_heads": 5, "num_key_value_heads": 5, "head_dim": None},
            "d_model .32. must be divisible by num_heads .5.",
        ),
    ],
)
def test_unsupported_checkpoint_fields(tmp_path: Path, changes: dict[str, Any], match: str) -> None:
    ckpt = _our_checkpoint(tmp_path / "c")
    hf.read_checkpoint(ckpt)  # valid as written
    _edit_config(ckpt, **changes)
    with pytest.raises(ValueError, match=match):
        hf.read_checkpoint(ckpt)


def test_unsupported_checkpoint_files(tmp_path: Path) -> None:
    ckpt = _our_checkpoint(tmp_path / "c")
    weights = ckpt / "model.safetensors"
    with safe_open(str(weights), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - not a dict
    save_file({**tensors, "model.layers.0.self_attn.q_proj.bias": torch.zeros(32)}, str(weights))
    with pytest.raises(ValueError, match="q_proj.bias .* not part of a Llama model"):
        hf.read_checkpoint(ckpt)
    # Tied: the LM head may be absent and the embedding is used for it.
    del tensors["lm_head.weight"]
    save_file(tensors, str(weights), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lm_head.weight is missing"):
        hf.read_checkpoint(ckpt)
    _edit_config(ckpt, tie_word_embeddings=True)
    model, _ = hf.load_checkpoint(ckpt)
    assert torch.equal(model.head.lm_head.weight, tensors["model.embed_tokens.weight"])
    # Sharded checkpoints are read through their index.
    half = len(tensors) // 2
    names = sorted(tensors)
    save_file({k: tensors[k] for k in names[:half]}, str(ckpt / "a.safetensors"))
    save_file({k: tensors[k] for k in names[half:]}, str(ckpt / "b.safetensors"))
    weights.unlink()
    index = {k: "a.safetensors" if i < half else "b.safetensors" for i, k in enumerate(names)}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    sharded, _ = hf.load_checkpoint(ckpt)
    assert torch.equal(sharded.head.lm_head.weight, model.head.lm_head.weight)
    (ckpt / "b.safetensors").unlink()
    with pytest.raises(ValueError, match="shard b.safetensors .* is missing"):
        hf.read_checkpoint(ckpt)
    (ckpt / "model.safetensors.index.json").unlink()
    with pytest.raises(ValueError, match="only safetensors checkpoints"):
        hf.read_checkpoint(ckpt)
    ckpt2 = _our_checkpoint(tmp_path / "d")
    (ckpt2 / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match="no tokenizer.json"):
        hf.read_checkpoint(ckpt2)
    with pytest.raises(ValueError, match="needs a directory"):
        hf.hf_dir("hf:")


def test_export_hf_option_errors(tmp_path: Path, monkeypatch: Any) -> None:
    config = _config()
    status, _ = _fake_swarm(config, _trained_stages(config), monkeypatch)
    with pytest.raises(ValueError, match="--format must be one of murmuration, hf"):
        export_model(status, config, tmp_path / "x", format="onnx")
    with pytest.raises(ValueError, match="--dtype applies to --format hf only"):
        export_model(status, config, tmp_path / "x", dtype="bfloat16")
    with pytest.raises(ValueError, match="--dtype must be one of float32, bfloat16"):
        export_model(status, config, tmp_path / "x", format="hf", dtype="float16")
    # An export of a model started from a checkpoint has no embedding norm to fold, and
    # reads back as the same function.
    ckpt = _our_checkpoint(tmp_path / "c")
    model, tok = load_model(ckpt)
    assert isinstance(tok, HFTokenizer)
    hf.write_checkpoint(tmp_path / "again", model.cfg, model.state_dict())
    again, _ = load_model(tmp_path / "again")
    ids = _ids(256, 2, 16, 0)
    with torch.no_grad():
        assert torch.equal(again(ids), model(ids))


# ---- a real swarm started from a checkpoint -----------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_swarm_init_from_hf_checkpoint(tmp_path: Path) -> None:
    """Head + 2 block stages started with ``--init hf:DIR``: the first evaluation (before any
    training step, activations in fp32 on the wire) equals transformers' loss on the same
    batches. Then, with the learning rate 0, ``node export --format hf`` gives back the
    checkpoint's tensors exactly."""
    from node.client import fetch_status
    from node.demo import LocalSwarm, wait_ready

    transformers = _transformers()
    ckpt = llama_checkpoint(tmp_path / "llama")
    settings = {
        **FAST_SWARM,
        "swarm.num_block_stages": "2",
        "train.eval_interval_s": "600",  # one evaluation once the pipeline is complete
        "train.eval_batches": "4",
        "train.wire_codec": "fp32",
        "train.lr": "0",
        "sync.method": "none",
    }
    swarm = LocalSwarm(tmp_path / "logs", settings)
    swarm.log_dir.mkdir()
    try:
        t0 = time.monotonic()
        head = swarm.start_node(0, extra=["--init", f"hf:{ckpt}"])
        for stage in (1, 2):
            swarm.start_node(stage, extra=["--init", f"hf:{ckpt}"])
        for a in swarm.addresses:
            wait_ready(a, 90, swarm)
        evals = wait_for(lambda: fetch_status(head)["evals"], 120, "the first evaluation")
        first_eval = evals[0]["loss"]
        status = fetch_status(head)
        start_s = time.monotonic() - t0

        config = _init_config(ckpt)
        assert status["fingerprint"] == model_fingerprint(config.model, 2, 0)
        dataset = open_dataset(config.data, shard=0, seed=0, vocab_size=config.model.vocab_size)
        batches = dataset.eval_batches(4, config.data.batch_size, config.data.seq_len)
        model = transformers.LlamaForCausalLM.from_pretrained(ckpt).eval()
        theirs = transformers_loss(model, batches)
        print(
            f"\n--init hf: swarm up in {start_s:.0f}s; first eval loss {first_eval:.7f}, "
            f"transformers {theirs:.7f} (relative difference "
            f"{abs(first_eval - theirs) / theirs:.1e}; ln V = {math.log(config.model.vocab_size):.3f})"
        )
        assert first_eval == pytest.approx(theirs, rel=1e-4)

        out = tmp_path / "export"
        cmd = [sys.executable, "-m", "node", "export", "--format", "hf", "--out", str(out)]
        cmd += ["--init", f"hf:{ckpt}", head]
        cmd += [arg for k, v in settings.items() for arg in ("--set", f"{k}={v}")]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        with (
            safe_open(str(ckpt / "model.safetensors"), framework="pt") as f,
            safe_open(str(out / "model.safetensors"), framework="pt") as g,
        ):
            assert set(f.keys()) == set(g.keys())
            for name in f.keys():  # noqa: SIM118 - not a dict
                assert torch.equal(f.get_tensor(name), g.get_tensor(name)), name
        assert (out / "tokenizer.json").read_bytes() == (ckpt / "tokenizer.json").read_bytes()
    finally:
        swarm.stop(grace_s=5.0)
