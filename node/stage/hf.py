"""Hugging Face Llama checkpoints: the swarm's model in their layout, and theirs in ours.

Owns the mapping between our model (``FullModel`` parameter names, ``ModelConfig``) and a
directory that ``transformers.LlamaForCausalLM.from_pretrained`` loads with no custom code
(``config.json``, ``model.safetensors``, ``generation_config.json``, tokenizer files):

- ``write_checkpoint``: our whole model's tensors to such a directory, in fp32 or bf16.
  Llama has no norm after the token embedding (ours has, ``ModelConfig.embed_norm``); an
  embedding is a lookup table and RMSNorm acts on each row alone, so row ``i`` of the written
  table is ``embed_norm(table[i])``, computed by the same ``RMSNorm`` the model runs: the
  lookup then returns exactly what our embedding and its norm return. Everything else maps
  one to one: rotary embeddings in the rotate-half layout on both sides (no permutation of
  the query and key rows), the same theta and epsilon, no biases, an untied LM head, SwiGLU
  ``w1, w3, w2`` as ``gate_proj, up_proj, down_proj``.
- ``read_checkpoint``: a ``ModelConfig`` derived from a checkpoint's ``config.json``
  (``embed_norm`` off, ``checkpoint`` set to its content hash), with every field that would
  make our model compute something else than theirs refused by name (another
  ``model_type``, grouped-query attention, biases, rope scaling, another activation or head
  width), and its tensors' names and shapes checked against that config from the
  safetensors headers alone. Tied embeddings are untied (the LM head starts as a copy).
- ``stage_tensors`` (one stage's tensors, read alone from the safetensors files, for
  ``node join --init hf:DIR``) and ``load_checkpoint`` (the whole ``FullModel``, for
  ``node generate``).

Reference: the Llama architecture (Touvron et al. 2023, section 2.2) as ``node.stage.model``
implements it, and the checkpoint layout of ``transformers``' Llama (its ``config.json`` keys
with their defaults and its tensor names). Needs neither ``transformers`` nor a network:
safetensors and JSON; a tokenizer is copied, or the byte-level one written
(``node.data.tokenizer``). Does not own collecting weights from a swarm or the own export
format (``node.stage.export``), nor the model's maths (``node.stage.model``).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from node.data.tokenizer import HFTokenizer, save_byte_tokenizer
from node.stage.model import (
    Block,
    FullModel,
    HeadStage,
    ModelConfig,
    RMSNorm,
    stage_blocks,
    stage_shapes,
)

PREFIX = "hf:"
"""``node join --init hf:DIR``: the init directory is a Hugging Face checkpoint."""

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
GENERATION_FILE = "generation_config.json"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS = "special_tokens_map.json"
PROVENANCE_FILE = "murmuration.json"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""Dtypes ``write_checkpoint`` writes."""

# Stage-local parameter names (as ``HeadStage`` / ``Block`` have them) to Llama's.
_HEAD_NAMES = {
    "tok_embedding.weight": "model.embed_tokens.weight",
    "final_norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight",
    "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wv.weight": "self_attn.v_proj.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.w1.weight": "mlp.gate_proj.weight",
    "mlp.w3.weight": "mlp.up_proj.weight",
    "mlp.w2.weight": "mlp.down_proj.weight",
}
# Buffers older transformers versions saved with the weights; not parameters of either model.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def is_hf(init: str) -> bool:
    """Whether an ``--init`` value names a Hugging Face checkpoint (``hf:DIR``)."""
    return init.startswith(PREFIX)


def hf_dir(init: str) -> Path:
    """The directory of an ``hf:DIR`` init value; ``ValueError`` for an empty one."""
    path = init.removeprefix(PREFIX)
    if not path:
        raise ValueError("--init hf:DIR needs a directory after 'hf:'")
    return Path(path)


def hf_name(stage: int, first_block: int, local: str) -> str:
    """A stage parameter's name in a Llama checkpoint (blocks renumbered globally)."""
    if stage == 0:
        return _HEAD_NAMES[local]
    prefix, index, rest = local.split(".", 2)
    assert prefix == "blocks", local
    return f"model.layers.{first_block + int(index)}.{_BLOCK_NAMES[rest]}"


# ---------------------------------------------------------------------------------------
# Writing


def to_hf_tensors(cfg: ModelConfig, tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``FullModel`` parameters (fp32, its names) to Llama's names, the embedding norm folded
    into the embedding table; ``ValueError`` unless ``tensors`` is exactly that model's."""
    with torch.device("meta"):
        expected = FullModel(HeadStage(cfg), [Block(cfg) for _ in range(cfg.num_blocks)])
    names = set(expected.state_dict())
    if set(tensors) != names:
        missing, extra = sorted(names - set(tensors)), sorted(set(tensors) - names)
        raise ValueError(f"not this model's parameters: missing {missing[:3]}, extra {extra[:3]}")
    out: dict[str, Tensor] = {}
    for name, value in tensors.items():
        if name == "head.embed_norm.weight":
            continue
        if name.startswith("head."):
            out[hf_name(0, 0, name.removeprefix("head."))] = value
        else:
            _, index, rest = name.split(".", 2)  # blocks.{global index}.{rest}
            out[f"model.layers.{index}.{_BLOCK_NAMES[rest]}"] = value
    table = tensors["head.tok_embedding.weight"].float()
    if cfg.embed_norm:
        norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        with torch.no_grad():
            norm.weight.copy_(tensors["head.embed_norm.weight"])
            table = norm(table)
    out["model.embed_tokens.weight"] = table
    return out


def hf_config(
    cfg: ModelConfig, dtype: str, bos_id: int | None, eos_id: int | None
) -> dict[str, Any]:
    """``config.json`` of a ``LlamaForCausalLM`` computing what ``cfg``'s model computes
    (with the embedding norm folded away). Rope theta is written both as transformers 5
    reads it (``rope_parameters``) and as earlier versions did (``rope_theta``)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.num_blocks,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "initializer_range": cfg.init_std,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": None,
        "use_cache": True,
        "dtype": dtype,
        "torch_dtype": dtype,
    }


def _write_tokenizer(out: Path, tokenizer: str, max_seq_len: int) -> tuple[int | None, int | None]:
    """The tokenizer files of ``out``: the byte-level tokenizer for ``""``, else a copy of
    the ``tokenizer.json`` at ``tokenizer`` (with the ``tokenizer_config.json`` and
    ``special_tokens_map.json`` beside it, if any). Returns its ``(bos, eos)`` ids."""
    target = out / TOKENIZER_FILE
    if not tokenizer:
        save_byte_tokenizer(target)
    elif Path(tokenizer).resolve() != target.resolve():
        shutil.copyfile(tokenizer, target)
    tok = HFTokenizer(str(target))
    source = Path(tokenizer).parent if tokenizer else None
    if source is not None and (source / TOKENIZER_CONFIG).is_file():
        for name in (TOKENIZER_CONFIG, SPECIAL_TOKENS):
            if (source / name).is_file() and source.resolve() != out.resolve():
                shutil.copyfile(source / name, out / name)
    else:
        # A plain fast tokenizer: transformers' generic class, which adds no tokens of its
        # own when encoding (ours add none either).
        doc: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": max_seq_len,
            "clean_up_tokenization_spaces": False,
        }
        if tok.bos_token is not None:
            doc["bos_token"] = tok.bos_token
        if tok.eos_token is not None:
            doc["eos_token"] = tok.eos_token
        (out / TOKENIZER_CONFIG).write_text(json.dumps(doc, indent=2) + "\n")
    return tok.bos_id, tok.eos_id


def write_checkpoint(
    out_dir: str | Path,
    cfg: ModelConfig,
    tensors: Mapping[str, Tensor],
    *,
    tokenizer: str = "",
    dtype: str = "float32",
    provenance: Mapping[str, Any] | None = None,
) -> None:
    """Write our whole model (``FullModel`` names, fp32) to ``out_dir`` as a Llama checkpoint
    in ``dtype`` (``float32`` or ``bfloat16``), with the tokenizer (``""``: the byte-level
    one) and, in ``murmuration.json``, ``provenance`` (where the weights came from)."""
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf = to_hf_tensors(cfg, tensors)
    bos_id, eos_id = _write_tokenizer(out, tokenizer, cfg.max_seq_len)
    weights = {k: v.to(DTYPES[dtype]).contiguous() for k, v in hf.items()}
    save_file(weights, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    config = hf_config(cfg, dtype, bos_id, eos_id)
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": None}
    (out / GENERATION_FILE).write_text(json.dumps(generation, indent=2) + "\n")
    if provenance is not None:
        (out / PROVENANCE_FILE).write_text(json.dumps(dict(provenance), indent=2) + "\n")


# ---------------------------------------------------------------------------------------
# Reading


@dataclass(frozen=True)
class Checkpoint:
    """A Llama checkpoint directory, checked: our config for it and where its tensors are."""

    path: Path
    model: ModelConfig
    """Our config computing what the checkpoint computes (``embed_norm`` off)."""
    tokenizer: str
    """Path of the checkpoint's ``tokenizer.json``."""
    files: dict[str, str]
    """Tensor name to the safetensors file (in ``path``) holding it."""
    tied: bool
    """``tie_word_embeddings``: the LM head is the embedding table."""


def _load_json(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(
            f"{path.parent} is not a Hugging Face checkpoint: no {path.name}"
        ) from None
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: unreadable ({e})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: not a JSON object")
    return doc


def _weight_files(root: Path) -> dict[str, str]:
    """Tensor name -> safetensors file, from the one file or from the shards' index."""
    if (root / WEIGHTS_FILE).is_file():
        with safe_open(str(root / WEIGHTS_FILE), framework="pt") as f:
            return {k: WEIGHTS_FILE for k in f.keys()}  # noqa: SIM118 - not a dict
    if (root / WEIGHTS_INDEX).is_file():
        weight_map = _load_json(root / WEIGHTS_INDEX).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{root / WEIGHTS_INDEX}: no weight_map")
        for file in set(weight_map.values()):
            if not (root / str(file)).is_file():
                raise ValueError(f"{root}: shard {file} named in {WEIGHTS_INDEX} is missing")
        return {str(k): str(v) for k, v in weight_map.items()}
    raise ValueError(
        f"{root}: no {WEIGHTS_FILE} or {WEIGHTS_INDEX} (only safetensors checkpoints are read; "
        "re-save a pytorch_model.bin one with save_pretrained(safe_serialization=True))"
    )


def _refuse(path: Path, field: str, value: Any, why: str) -> ValueError:
    return ValueError(f"{path}: {field} = {value!r} is not supported: {why}")


def _model_config(path: Path, doc: Mapping[str, Any], checkpoint: str) -> tuple[ModelConfig, bool]:
    """Our ``ModelConfig`` for a Llama ``config.json`` (transformers' defaults for absent
    optional keys), and whether its embeddings are tied; ``ValueError`` naming the field
    for anything our model would compute differently."""
    model_type = doc.get("model_type")
    if model_type != "llama":
        raise _refuse(path, "model_type", model_type, "only Llama checkpoints ('llama') are read")
    required = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
    )
    for key in required:
        if not isinstance(doc.get(key), int) or isinstance(doc.get(key), bool):
            raise ValueError(f"{path}: {key} missing or not an integer ({doc.get(key)!r})")
    heads, hidden = doc["num_attention_heads"], doc["hidden_size"]
    if doc.get("hidden_act", "silu") != "silu":
        raise _refuse(path, "hidden_act", doc["hidden_act"], "the MLP is SwiGLU with silu")
    kv_heads = doc.get("num_key_value_heads")
    if kv_heads is not None and kv_heads != heads:
        raise _refuse(
            path,
            "num_key_value_heads",
            kv_heads,
            f"grouped-query attention; only num_key_value_heads = num_attention_heads ({heads})",
        )
    head_dim = doc.get("head_dim")
    if head_dim is not None and head_dim * heads != hidden:
        raise _refuse(
            path, "head_dim", head_dim, f"the head width must be hidden_size / heads ({hidden})"
        )
    for key in ("attention_bias", "mlp_bias"):
        if doc.get(key, False):
            raise _refuse(path, key, doc[key], "the model has no biases")
    if doc.get("rope_scaling") is not None:
        raise _refuse(path, "rope_scaling", doc["rope_scaling"], "only plain rotary embeddings")
    theta = doc.get("rope_theta", 10000.0)
    params = doc.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict):
            raise ValueError(f"{path}: rope_parameters must be an object, got {params!r}")
        if params.get("rope_type", "default") != "default":
            raise _refuse(
                path, "rope_parameters.rope_type", params["rope_type"], "only 'default' rotary"
            )
        extra = sorted(set(params) - {"rope_type", "rope_theta"})
        if extra:
            raise _refuse(path, f"rope_parameters.{extra[0]}", params[extra[0]], "only theta")
        theta = params.get("rope_theta", theta)
    tied = bool(doc.get("tie_word_embeddings", False))
    try:
        cfg = ModelConfig(
            vocab_size=doc["vocab_size"],
            d_model=hidden,
            num_heads=heads,
            num_blocks=doc["num_hidden_layers"],
            ffn_dim=doc["intermediate_size"],
            max_seq_len=int(doc.get("max_position_embeddings", 2048)),
            rope_theta=float(theta),
            norm_eps=float(doc.get("rms_norm_eps", 1e-6)),
            init_std=float(doc.get("initializer_range", 0.02)),
            embed_norm=False,
            checkpoint=checkpoint,
        )
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from None
    return cfg, tied


def checkpoint_hash(root: Path, files: Mapping[str, str], tokenizer: Path) -> str:
    """16 hex chars of sha256 over ``config.json``, the weight files (by name) and the
    tokenizer: the same on every node that has the same checkpoint."""
    digest = hashlib.sha256()
    for path in [root / CONFIG_FILE, *(root / f for f in sorted(set(files.values()))), tokenizer]:
        digest.update(path.name.encode() + b"\0")
        with path.open("rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()[:16]


def _expected(cfg: ModelConfig, tied: bool) -> dict[str, tuple[int, ...]]:
    """Llama tensor names and shapes a checkpoint for ``cfg`` holds (no LM head if tied)."""
    out = {
        hf_name(0, 0, k): tuple(v) for k, v in stage_shapes(cfg, 1, 0).items() if k in _HEAD_NAMES
    }
    if tied:
        del out["lm_head.weight"]
    out.update({hf_name(1, 0, k): tuple(v) for k, v in stage_shapes(cfg, 1, 1).items()})
    return out


def _check_tensors(root: Path, cfg: ModelConfig, files: Mapping[str, str], tied: bool) -> None:
    """Every tensor the config implies, with its shape, and no other (headers only)."""
    expected = _expected(cfg, tied)
    extra = sorted(k for k in files if k not in expected and not k.endswith(_IGNORED_SUFFIXES))
    if tied:
        extra = [k for k in extra if k != "lm_head.weight"]
    if extra:
        raise ValueError(
            f"{root}: tensor {extra[0]} (and {len(extra) - 1} more) is not part of a Llama "
            "model without biases; this checkpoint is not supported"
        )
    missing = sorted(set(expected) - set(files))
    if missing:
        raise ValueError(f"{root}: tensor {missing[0]} is missing ({len(missing)} in all)")
    by_file: dict[str, list[str]] = {}
    for name in expected:
        by_file.setdefault(files[name], []).append(name)
    for file, names in by_file.items():
        with safe_open(str(root / file), framework="pt") as f:
            for name in names:
                shape = tuple(f.get_slice(name).get_shape())
                if shape != expected[name]:
                    raise ValueError(
                        f"{root}: tensor {name} has shape {shape}, config.json implies "
                        f"{expected[name]}"
                    )


def read_checkpoint(directory: str | Path) -> Checkpoint:
    """A Llama checkpoint directory, checked (config, tensor names and shapes, tokenizer),
    with our config for it; ``ValueError`` naming what is missing or unsupported."""
    root = Path(directory)
    if not root.is_dir():
        raise ValueError(f"Hugging Face checkpoint directory not found: {root}")
    doc = _load_json(root / CONFIG_FILE)
    files = _weight_files(root)
    tokenizer = root / TOKENIZER_FILE
    if not tokenizer.is_file():
        raise ValueError(
            f"{root}: no {TOKENIZER_FILE}; the swarm's vocabulary comes from the checkpoint's "
            "fast tokenizer (AutoTokenizer.from_pretrained(...).save_pretrained(DIR) writes it)"
        )
    cfg, tied = _model_config(root / CONFIG_FILE, doc, checkpoint_hash(root, files, tokenizer))
    _check_tensors(root, cfg, files, tied)
    vocab = HFTokenizer(str(tokenizer)).vocab_size
    if vocab > cfg.vocab_size:
        raise ValueError(
            f"{tokenizer}: the tokenizer has {vocab} tokens but config.json's vocab_size is "
            f"{cfg.vocab_size}"
        )
    return Checkpoint(root, cfg, str(tokenizer), dict(files), tied)


def stage_tensors(ckpt: Checkpoint, num_block_stages: int, stage: int) -> dict[str, Tensor]:
    """Stage ``stage``'s parameters (its ``state_dict`` names, fp32), reading only its own
    tensors from the safetensors files."""
    cfg = ckpt.model
    first = stage_blocks(cfg, num_block_stages, stage).start
    local = list(stage_shapes(cfg, num_block_stages, stage))
    source = {k: hf_name(stage, first, k) for k in local}
    if ckpt.tied and stage == 0:
        source["lm_head.weight"] = "model.embed_tokens.weight"
    by_file: dict[str, list[str]] = {}
    for name in set(source.values()):
        by_file.setdefault(ckpt.files[name], []).append(name)
    read: dict[str, Tensor] = {}
    for file, names in by_file.items():
        with safe_open(str(ckpt.path / file), framework="pt") as f:
            read.update({name: f.get_tensor(name).float() for name in names})
    return {k: read[name].clone() for k, name in source.items()}


def load_checkpoint(directory: str | Path) -> tuple[FullModel, Checkpoint]:
    """The checkpoint as a ``FullModel`` in eval mode on CPU (fp32), and the checkpoint."""
    ckpt = read_checkpoint(directory)
    cfg = ckpt.model
    with torch.device("meta"):
        model = FullModel(HeadStage(cfg), [Block(cfg) for _ in range(cfg.num_blocks)])
    tensors = {f"head.{k}": v for k, v in stage_tensors(ckpt, 1, 0).items()}
    tensors.update({k: v for k, v in stage_tensors(ckpt, 1, 1).items()})
    model.load_state_dict(tensors, strict=True, assign=True)
    return model.eval(), ckpt
