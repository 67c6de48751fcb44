"""A real model out of the swarm: export, load back, generate, and start a new swarm from it.

Owns the exported-model format (with ``--format hf``, a Hugging Face Llama checkpoint instead,
written by ``node.stage.hf``), a directory holding:

- ``model.safetensors``: every parameter of the whole model under ``FullModel``'s names
  (``head.tok_embedding.weight``, ``blocks.{global index}.attn.wq.weight``, ...), fp32;
- ``config.json``: the ``ModelConfig``, the swarm's split and seed, its fingerprint, the
  tokenizer (``"bytes"`` or ``"tokenizer.json"``, a copy of which sits beside it) and, per
  stage, which replica the weights came from and at which step;

``export_model`` (collect the current weights of every stage from live replicas, one per
stage, the most advanced first, over the node's ``/rpc`` endpoint), ``load_export`` (a
``FullModel`` for evaluation or generation with no swarm running; ``load_model`` reads either
format), ``generate`` (temperature and top-k sampling, with a KV cache), ``eval_loss``, and
``init_stage`` (a stage's slice of an export or of a Hugging Face checkpoint, loaded into a
``StageRunner`` on its compute thread, for ``node join --init DIR`` / ``--init hf:DIR``). The
stage slice is cut by global block index, so a model exported from ``N`` block stages can
start a swarm with another ``N`` as long as the ``ModelConfig`` is the same.

Does not own the model's maths (``node.stage.model``), the data (``node.data``) or the daemon.
Exports are read with ``safetensors`` (no pickle, no ``torch.load``).
"""

from __future__ import annotations

import json
import shutil
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from node.client import fetch_status
from node.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from node.stage import hf
from node.stage.model import (
    Block,
    FullModel,
    HeadStage,
    KVCache,
    ModelConfig,
    model_fingerprint,
    stage_blocks,
    stage_shapes,
)
from protocol.auth import AUTH_HEADER, Identity, SwarmAuth, frame_digest
from protocol.frames import join_frame
from protocol.messages import (
    Error,
    FetchState,
    StageState,
    decode_message,
    encode_message,
)

if TYPE_CHECKING:
    from node.config import Config
    from node.stage.runner import StageRunner

EXPORT_FORMAT = "murmuration-export"
EXPORT_VERSION = 1
MODEL_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
FORMATS = ("murmuration", "hf")
"""``node export --format``: our own layout (the default) or a Hugging Face Llama checkpoint."""


@dataclass(frozen=True)
class ExportInfo:
    """What ``config.json`` of an export says."""

    model: ModelConfig
    num_block_stages: int
    seed: int
    fingerprint: str
    tokenizer: str
    """``"bytes"`` or the file name of the tokenizer.json inside the export directory."""
    sources: list[dict[str, Any]]
    """Per stage: ``stage``, ``peer_id``, ``address``, ``step``, ``samples``."""


# ---------------------------------------------------------------------------------------
# Names


def global_name(stage: int, first_block: int, local: str) -> str:
    """A stage parameter's name in ``FullModel`` (head: ``head.*``; blocks renumbered)."""
    if stage == 0:
        return f"head.{local}"
    prefix, index, rest = local.split(".", 2)
    assert prefix == "blocks", local
    return f"blocks.{first_block + int(index)}.{rest}"


# ---------------------------------------------------------------------------------------
# Export


def fetch_stage_state(
    address: str, stage: int, timeout_s: float = 60.0, auth: SwarmAuth | None = None
) -> StageState:
    """One replica's state over ``POST /rpc`` (with ``auth``: a sealed request, and a reply
    that must be sealed by a swarm member); ``ValueError`` if it refuses or is unreachable."""
    buffers = encode_message(FetchState(stage=stage))
    digest = frame_digest(buffers)
    sent = auth.sign_request(address, "POST", "/rpc", digest, time.time()) if auth else None
    headers = {AUTH_HEADER: sent.header} if sent else {}
    url = f"http://{address}/rpc"
    req = urllib.request.Request(url, data=join_frame(buffers), method="POST", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            raw = resp.read()
            if sent is not None:
                sent.open_reply(resp.status, resp.headers.get(AUTH_HEADER), frame_digest([raw]))
            reply = decode_message(raw)
            if sent is not None:
                sent.check_reply(reply)
    except urllib.error.HTTPError as e:
        try:
            refusal = decode_message(e.read())
        except Exception:  # any undecodable body: report the HTTP status
            refusal = None
        detail = f"{refusal.code}: {refusal.message}" if isinstance(refusal, Error) else str(e)
        raise ValueError(f"{address} refused the state fetch ({detail})") from None
    except (urllib.error.URLError, OSError) as e:
        raise ValueError(f"cannot reach {address}: {e}") from None
    if not isinstance(reply, StageState) or reply.stage != stage:
        raise ValueError(f"{address} did not answer with the state of stage {stage}")
    return reply


def _candidates(status: dict[str, Any], stage: int, far: bool = True) -> list[dict[str, Any]]:
    """Live replicas of ``stage`` known to the node (itself included), most advanced first.
    A stage its table does not hold (neighbourhood tables) is reached through the contact
    its summary names: that replica's own status lists its stage."""
    found = {p["peer_id"]: p for p in status["peers"].get(str(stage), []) if p.get("ready", True)}
    if status["stage"] == stage:
        found[status["peer_id"]] = {
            "peer_id": status["peer_id"],
            "address": status["address"],
            "step": status["step"],
        }
    summary = status.get("stages", {}).get(str(stage), {})
    if not found and far and summary.get("contact"):
        try:
            return _candidates(fetch_status(summary["contact"]), stage, far=False)
        except ValueError:
            return []
    return sorted(found.values(), key=lambda p: -int(p["step"]))


def collect_weights(
    status: dict[str, Any], config: Config, timeout_s: float = 60.0
) -> tuple[dict[str, Tensor], list[dict[str, Any]]]:
    """Every stage's parameters under ``FullModel`` names, fetched from one live replica per
    stage (the one at the highest step that answers), and where each came from."""
    from node.identity import swarm_auth

    cfg, num_block_stages = config.model, config.swarm.num_block_stages
    auth = swarm_auth(config.net, Identity.generate())  # a keyed swarm's key, from the config
    tensors: dict[str, Tensor] = {}
    sources: list[dict[str, Any]] = []
    for stage in range(num_block_stages + 1):
        expected = stage_shapes(cfg, num_block_stages, stage)
        errors: list[str] = []
        for peer in _candidates(status, stage):
            try:
                state = fetch_stage_state(peer["address"], stage, timeout_s, auth)
            except ValueError as e:
                errors.append(str(e))
                continue
            params = {
                k.removeprefix("param."): v
                for k, v in state.tensors.items()
                if k.startswith("param.")
            }
            shapes = {k: v.shape for k, v in params.items()}
            if shapes != expected:
                raise ValueError(
                    f"stage {stage} at {peer['address']} holds parameters that do not fit the "
                    "model of the given config; pass the swarm's --config / --set"
                )
            first = stage_blocks(cfg, num_block_stages, stage).start
            for local, value in params.items():
                tensors[global_name(stage, first, local)] = value.float().contiguous().clone()
            sources.append(
                {
                    "stage": stage,
                    "peer_id": peer["peer_id"],
                    "address": peer["address"],
                    "step": state.step,
                    "samples": state.samples,
                }
            )
            break
        else:
            why = "; ".join(errors) if errors else "the node knows no live replica"
            raise ValueError(f"cannot collect stage {stage}: {why}")
    return tensors, sources


def check_fingerprint(status: dict[str, Any], config: Config) -> None:
    """``ValueError`` unless ``config`` describes the model the node at hand trains."""
    ours = model_fingerprint(config.model, config.swarm.num_block_stages, config.swarm.seed)
    if ours != status["fingerprint"]:
        raise ValueError(
            f"the node's model fingerprint is {status['fingerprint']}, but the given config "
            f"(model preset {config.swarm.model!r}, {config.swarm.num_block_stages} block stages, "
            f"seed {config.swarm.seed}) gives {ours}; pass the swarm's --config / --set"
        )


def export_model(
    status: dict[str, Any],
    config: Config,
    out_dir: str | Path,
    timeout_s: float = 60.0,
    *,
    format: str = "murmuration",
    dtype: str = "float32",
) -> ExportInfo:
    """Collect the swarm's weights and write ``out_dir`` (created if missing) in ``format``
    (``murmuration``, always fp32, or ``hf``, in ``dtype``: float32 or bfloat16)."""
    if format not in FORMATS:
        raise ValueError(f"--format must be one of {', '.join(FORMATS)}, not {format!r}")
    if format == "murmuration" and dtype != "float32":
        raise ValueError("--dtype applies to --format hf only (our own format is fp32)")
    if dtype not in hf.DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(hf.DTYPES)}, not {dtype!r}")
    check_fingerprint(status, config)
    tensors, sources = collect_weights(status, config, timeout_s)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    info = ExportInfo(
        model=config.model,
        num_block_stages=config.swarm.num_block_stages,
        seed=config.swarm.seed,
        fingerprint=status["fingerprint"],
        tokenizer=TOKENIZER_FILE if config.data.tokenizer or format == "hf" else "bytes",
        sources=sources,
    )
    if format == "hf":
        provenance = {"format": EXPORT_FORMAT, "version": EXPORT_VERSION, **asdict(info)}
        hf.write_checkpoint(
            out,
            config.model,
            tensors,
            tokenizer=config.data.tokenizer,
            dtype=dtype,
            provenance=provenance,
        )
        return info
    if config.data.tokenizer:
        shutil.copyfile(config.data.tokenizer, out / TOKENIZER_FILE)
    save_file(tensors, str(out / MODEL_FILE), metadata={"format": EXPORT_FORMAT})
    document = {"format": EXPORT_FORMAT, "version": EXPORT_VERSION, **asdict(info)}
    (out / CONFIG_FILE).write_text(json.dumps(document, indent=2) + "\n")
    return info


# ---------------------------------------------------------------------------------------
# Load back


def _read_config(model_dir: str | Path) -> tuple[Path, Any]:
    """The path of an export's ``config.json`` and its JSON; ``ValueError`` when it is
    missing or unreadable."""
    path = Path(model_dir) / CONFIG_FILE
    try:
        return path, json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{model_dir} is not an exported model: no {CONFIG_FILE}") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: unreadable ({e})") from None


def read_info(model_dir: str | Path) -> ExportInfo:
    """``config.json`` of an export, checked; ``ValueError`` for anything else."""
    path, doc = _read_config(model_dir)
    if not isinstance(doc, dict) or doc.get("format") != EXPORT_FORMAT:
        raise ValueError(f"{path}: not a Murmuration export (format {doc.get('format')!r})")
    if doc.get("version") != EXPORT_VERSION:
        raise ValueError(f"{path}: export version {doc.get('version')}, expected {EXPORT_VERSION}")
    if not (Path(model_dir) / MODEL_FILE).is_file():
        raise ValueError(f"{model_dir} is not an exported model: no {MODEL_FILE}")
    try:
        names = {f.name for f in fields(ModelConfig)}
        model = ModelConfig(**{k: v for k, v in doc["model"].items() if k in names})
        return ExportInfo(
            model=model,
            num_block_stages=int(doc["num_block_stages"]),
            seed=int(doc["seed"]),
            fingerprint=str(doc["fingerprint"]),
            tokenizer=str(doc["tokenizer"]),
            sources=list(doc["sources"]),
        )
    except (KeyError, TypeError) as e:
        raise ValueError(f"{path}: missing or malformed field ({e})") from None


def _read_tensors(model_dir: str | Path, names: Sequence[str] | None = None) -> dict[str, Tensor]:
    """Tensors of ``model.safetensors`` (only ``names`` when given)."""
    path = Path(model_dir) / MODEL_FILE
    with safe_open(str(path), framework="pt") as f:
        keys = list(f.keys())
        wanted = keys if names is None else list(names)
        missing = sorted(set(wanted) - set(keys))
        if missing:
            raise ValueError(f"{path} lacks {len(missing)} tensor(s), e.g. {missing[0]}")
        return {k: f.get_tensor(k) for k in wanted}


def load_export(model_dir: str | Path) -> tuple[FullModel, ExportInfo]:
    """The exported model as a ``FullModel`` in eval mode on CPU, and its info."""
    info = read_info(model_dir)
    cfg = info.model
    with torch.device("meta"):
        model = FullModel(HeadStage(cfg), [Block(cfg) for _ in range(cfg.num_blocks)])
    tensors = _read_tensors(model_dir)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    if {k: v.shape for k, v in tensors.items()} != expected:
        raise ValueError(f"{model_dir}: the tensors do not match the model in {CONFIG_FILE}")
    model.load_state_dict(tensors, strict=True, assign=True)
    return model.eval(), info


def load_export_tokenizer(model_dir: str | Path, info: ExportInfo) -> ByteTokenizer | HFTokenizer:
    """The tokenizer the exported model was trained with."""
    if info.tokenizer == "bytes":
        return ByteTokenizer()
    return load_tokenizer(str(Path(model_dir) / info.tokenizer))


def load_model(model_dir: str | Path) -> tuple[FullModel, ByteTokenizer | HFTokenizer]:
    """The model and tokenizer of a directory written by ``node export`` in either format (a
    Hugging Face Llama checkpoint is recognised by its ``config.json``'s ``model_type``)."""
    _, doc = _read_config(model_dir)
    if isinstance(doc, dict) and "model_type" in doc:
        model, ckpt = hf.load_checkpoint(model_dir)
        return model, HFTokenizer(ckpt.tokenizer)
    model, info = load_export(model_dir)
    return model, load_export_tokenizer(model_dir, info)


@torch.no_grad()
def eval_loss(model: FullModel, batches: Sequence[tuple[Tensor, Tensor]]) -> float:
    """Mean of the per-batch mean cross-entropy, as a head node's evaluation computes it."""
    losses = [float(model.loss(ids, labels)) for ids, labels in batches]
    return sum(losses) / len(losses)


@torch.no_grad()
def generate(
    model: FullModel,
    tokenizer: ByteTokenizer | HFTokenizer,
    prompt: str,
    *,
    max_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int = 40,
    seed: int = 0,
    cache: bool = True,
) -> str:
    """``max_tokens`` tokens sampled after ``prompt`` (decoded, without the prompt); see
    ``generate_ids``."""
    ids = tokenizer.encode(prompt) if prompt else tokenizer.encode("\n\n")
    if not ids:
        raise ValueError("the prompt encodes to no tokens")
    out = generate_ids(
        model,
        ids,
        max_tokens=max_tokens,
        temperature=temperature,
        top_k=top_k,
        seed=seed,
        cache=cache,
    )
    return tokenizer.decode(out)


@torch.no_grad()
def generate_ids(
    model: FullModel,
    ids: Sequence[int],
    *,
    max_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int = 40,
    seed: int = 0,
    cache: bool = True,
) -> list[int]:
    """``max_tokens`` token ids sampled after the prompt ``ids``.

    ``temperature`` 0 is greedy; ``top_k`` 0 samples from the whole vocabulary. The model
    sees at most ``max_seq_len`` tokens: when the context would outgrow that, it restarts
    from its last ``max_seq_len // 2`` tokens (at positions from 0 again). With ``cache``
    (the default) each step computes only the new token against the keys and values kept
    from the earlier ones, and a restart computes the kept half once; without, each step
    recomputes the whole context. Both give the same tokens.
    """
    if max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {max_tokens}")
    if temperature < 0:
        raise ValueError(f"--temperature must be >= 0, got {temperature}")
    if top_k < 0:
        raise ValueError(f"--top-k must be >= 0, got {top_k}")
    if not ids:
        raise ValueError("the prompt encodes to no tokens")
    limit = model.cfg.max_seq_len
    keep = max(1, limit // 2)
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    tokens = list(ids)
    start = max(0, len(tokens) - limit)  # the context is tokens[start:]
    kv: KVCache | None = None
    for _ in range(max_tokens):
        if len(tokens) - start > limit:
            start = len(tokens) - keep
            kv = None
        if not cache:
            logits = model(torch.tensor([tokens[start:]]))[0, -1].float()
        else:
            if kv is None:
                kv = KVCache(model.cfg)
            new = tokens[start + kv.length :]
            logits = model(torch.tensor([new]), kv)[0, -1].float()
        if temperature == 0:
            token = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k and top_k < logits.numel():
                cutoff = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < cutoff, float("-inf"))
            token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
        out.append(token)
        tokens.append(token)
    return out


# ---------------------------------------------------------------------------------------
# Start a swarm from an export


def check_init_dir(init_dir: str, cfg: ModelConfig) -> ModelConfig:
    """``ValueError`` unless ``init_dir`` is an export (or, ``hf:DIR``, a Hugging Face
    checkpoint) of a model with config ``cfg``; returns the model config it holds."""
    hf_init = hf.is_hf(init_dir)
    theirs = hf.read_checkpoint(hf.hf_dir(init_dir)).model if hf_init else read_info(init_dir).model
    if theirs != cfg:
        diffs = [
            f"{f.name} {getattr(theirs, f.name)!r} ({'checkpoint' if hf_init else 'export'}) "
            f"vs {getattr(cfg, f.name)!r}"
            for f in fields(ModelConfig)
            if getattr(theirs, f.name) != getattr(cfg, f.name)
        ]
        raise ValueError(
            f"--init {init_dir}: the {'checkpoint' if hf_init else 'exported model'} differs "
            "from this node's model config: " + ", ".join(diffs)
        )
    return theirs


def stage_slice(
    init_dir: str, cfg: ModelConfig, num_block_stages: int, stage: int
) -> dict[str, Tensor]:
    """Stage ``stage``'s parameters from an export or an ``hf:DIR`` checkpoint, named as
    ``StageRunner.load`` expects (``param.<local name>``)."""
    check_init_dir(init_dir, cfg)
    if hf.is_hf(init_dir):
        ckpt = hf.read_checkpoint(hf.hf_dir(init_dir))
        return {f"param.{k}": v for k, v in hf.stage_tensors(ckpt, num_block_stages, stage).items()}
    first = stage_blocks(cfg, num_block_stages, stage).start
    local = list(stage_shapes(cfg, num_block_stages, stage))
    names = [global_name(stage, first, k) for k in local]
    tensors = _read_tensors(init_dir, names)
    return {f"param.{k}": tensors[g] for k, g in zip(local, names, strict=True)}


def init_stage(runner: StageRunner, init_dir: str) -> None:
    """Load this runner's stage from the export (or ``hf:DIR`` checkpoint) at ``init_dir``
    (call on the compute thread): its weights, a fresh optimizer, step 0 (so the warm-up runs
    again)."""
    c = runner.config
    tensors = stage_slice(init_dir, c.model, c.swarm.num_block_stages, runner.stage)
    runner.load(tensors, 0, 0)
