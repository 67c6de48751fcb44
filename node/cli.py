"""Command line: ``node join``, ``status``, ``profile``, ``demo``, ``export``, ``generate``
(also ``murmur``).

Owns, besides, the config a Hugging Face checkpoint implies (``--init hf:DIR``: the model
and tokenizer come from its files, ``with_init_model``).

Owns argument parsing, user-facing output and exit codes. Flags are what a volunteer types;
everything else lives in the TOML config file (``--config``), the environment
(``MURMUR_SECTION_FIELD``) or, for one-off experiments, ``--set section.field=value``.
``node join --help-config`` lists every setting with its default and meaning.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from node.allocator import reuse_freed_memory
from node.client import fetch_status, operator_auth, post_to_node
from node.config import (
    Config,
    SyncMethod,
    choices,
    field_docs,
    parse_sets,
    resolve_config,
)
from node.daemon import Node
from node.data.dataset import model_vocab_size
from node.demo import run_demo
from node.display import format_profile, format_status
from node.identity import load_identity
from node.logs import set_context, setup_logging
from node.stage import hf
from node.stage.export import (
    FORMATS,
    check_init_dir,
    export_model,
    generate,
    load_model,
)
from node.stage.model import preset
from swarm.recovery import RecoveryMethod


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(args.func(args))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="node",
        description="Murmuration: train one model on many volunteers' machines.",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    _add_join(sub)
    _add_status(sub)
    _add_profile(sub)
    _add_demo(sub)
    _add_export(sub)
    _add_generate(sub)
    return p


def _add_join(sub: Any) -> None:
    j = sub.add_parser("join", help="run a daemon that serves one stage of the swarm's model")
    j.add_argument(
        "--stage",
        help="'auto' (default: an empty stage, else the weakest by throughput; may move "
        "later to balance the swarm), K (0 = head; never rebalanced) or 'relay' (no stage: "
        "only relay for nodes behind NATs)",
    )
    j.add_argument(
        "--listen", metavar="HOST:PORT", help="address to serve on (default 0.0.0.0:7070)"
    )
    j.add_argument("--announce", metavar="HOST", help="address peers should use to reach this node")
    j.add_argument(
        "--bootstrap", metavar="HOST:PORT[,...]", help="known peers, for swarms beyond the LAN"
    )
    j.add_argument("--swarm", metavar="NAME", help="swarm name; only peers of the same swarm talk")
    j.add_argument("--config", metavar="FILE.toml", help="configuration file")
    j.add_argument(
        "--sync",
        choices=choices(SyncMethod),
        help="how replicas of a stage stay together (default noloco)",
    )
    j.add_argument(
        "--recovery",
        choices=choices(RecoveryMethod),
        help="how a stage whose replicas are all gone is rebuilt (default checkfree)",
    )
    j.add_argument("--device", help="torch device for this stage (cpu, cuda, cuda:1)")
    j.add_argument(
        "--data",
        metavar="PATH",
        help=".txt/.jsonl/.parquet file, directory, glob, or hf:NAME_OR_DIR (default: stdlib text)",
    )
    j.add_argument(
        "--state-dir", metavar="DIR", help="keep this node's identity here across restarts"
    )
    j.add_argument(
        "--swarm-key",
        metavar="SECRET",
        help="close the swarm: only nodes with this key (16+ characters) may talk to it; "
        "shows in ps, so prefer --swarm-key-file (default: an open swarm)",
    )
    j.add_argument("--swarm-key-file", metavar="FILE", help="file holding the swarm key")
    j.add_argument(
        "--init",
        metavar="DIR",
        help="start a stage with no live replica from this exported model (node export), or "
        "hf:DIR from a local Hugging Face Llama checkpoint (its model, tokenizer and weights)",
    )
    j.add_argument(
        "--no-zeroconf", action="store_true", help="do not announce or browse on the LAN"
    )
    j.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="serve Prometheus metrics on this port (default: none)",
    )
    j.add_argument("--log-level", help="debug, info, warning, error")
    j.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="override one setting (repeatable)",
    )
    j.add_argument("--help-config", action="store_true", help="list every setting and exit")
    j.set_defaults(func=_cmd_join)


def _add_status(sub: Any) -> None:
    s = sub.add_parser("status", help="show a running node's view of the swarm")
    s.add_argument("address", metavar="ADDRESS", help="HOST:PORT of the node")
    s.add_argument("--json", action="store_true", help="print the raw JSON")
    s.set_defaults(func=_cmd_status)


def _add_profile(sub: Any) -> None:
    pr = sub.add_parser(
        "profile",
        help="where a running node's compute thread spends its CPU, by torch operator",
    )
    pr.add_argument("address", metavar="ADDRESS", help="HOST:PORT of the node")
    pr.add_argument(
        "--seconds", type=float, default=10.0, help="how long to profile (default 10, at most 300)"
    )
    pr.add_argument("--top", type=int, default=15, help="operators to list (default 15)")
    pr.add_argument("--json", action="store_true", help="print the raw JSON, every operator")
    pr.add_argument(
        "--config", metavar="FILE", help="TOML config whose swarm key signs the request"
    )
    pr.set_defaults(func=_cmd_profile)


def _add_demo(sub: Any) -> None:
    d = sub.add_parser("demo", help="start a local swarm on this machine, train, print a summary")
    d.add_argument("--block-stages", type=int, default=3, help="block stages (default 3)")
    d.add_argument(
        "--replicas", type=int, default=1, help="replicas of each block stage (default 1)"
    )
    d.add_argument("--heads", type=int, default=1, help="head-stage nodes (default 1)")
    d.add_argument(
        "--budget-s", type=float, default=180.0, help="training time in seconds (default 180)"
    )
    d.add_argument("--port", type=int, default=0, help="first port (default: free ports)")
    d.add_argument("--config", metavar="FILE.toml", help="configuration file passed to every node")
    d.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="override one setting in every node",
    )
    d.add_argument("--json", action="store_true", help="print the summary as JSON on the last line")
    d.add_argument("--logs", metavar="DIR", help="write each node's log here (default: a temp dir)")
    d.set_defaults(func=_cmd_demo)


def _add_export(sub: Any) -> None:
    e = sub.add_parser("export", help="write the swarm's current model to a directory")
    e.add_argument("address", metavar="ADDRESS", help="HOST:PORT of any node of the swarm")
    e.add_argument("--out", required=True, metavar="DIR", help="directory to write the model to")
    e.add_argument(
        "--config", metavar="FILE.toml", help="the swarm's configuration file (model, seed)"
    )
    e.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="the swarm's settings beyond the file (repeatable)",
    )
    e.add_argument(
        "--timeout-s", type=float, default=60.0, help="deadline of each state fetch (default 60)"
    )
    e.add_argument(
        "--format",
        choices=FORMATS,
        default="murmuration",
        help="murmuration (default: read by node generate and --init DIR) or hf: a Hugging "
        "Face Llama checkpoint (transformers' from_pretrained; node generate and --init hf:DIR)",
    )
    e.add_argument(
        "--dtype",
        choices=tuple(hf.DTYPES),
        default="float32",
        help="weights' dtype with --format hf (default float32)",
    )
    e.add_argument(
        "--init",
        metavar="hf:DIR",
        help="the swarm's --init hf:DIR, if it started from a Hugging Face checkpoint (its "
        "model config comes from there)",
    )
    e.set_defaults(func=_cmd_export)


def _add_generate(sub: Any) -> None:
    g = sub.add_parser("generate", help="sample text from an exported model (no swarm needed)")
    g.add_argument(
        "--model",
        required=True,
        metavar="DIR",
        help="directory written by node export (either format) or a Hugging Face Llama checkpoint",
    )
    g.add_argument("--prompt", required=True, help="text to continue")
    g.add_argument(
        "--temperature", type=float, default=0.8, help="sampling temperature; 0 = greedy (0.8)"
    )
    g.add_argument(
        "--top-k", type=int, default=40, help="sample among the K likeliest tokens; 0 = all (40)"
    )
    g.add_argument("--max-tokens", type=int, default=200, help="tokens to generate (200)")
    g.add_argument("--seed", type=int, default=0, help="sampling seed (0)")
    g.set_defaults(func=_cmd_generate)


def join_config(args: argparse.Namespace) -> Config:
    overrides: dict[str, Any] = parse_sets(args.set)
    flags = {
        "node.stage": args.stage,
        "net.listen": args.listen,
        "net.announce": args.announce,
        "net.bootstrap": args.bootstrap,
        "swarm.name": args.swarm,
        "node.device": args.device,
        "sync.method": args.sync,
        "recovery.method": args.recovery,
        "data.path": args.data,
        "node.state_dir": args.state_dir,
        "net.swarm_key": args.swarm_key,
        "net.swarm_key_file": args.swarm_key_file,
        "node.init_dir": args.init,
        "net.metrics_port": args.metrics_port,
        "node.log_level": args.log_level,
        "net.zeroconf": False if args.no_zeroconf else None,
    }
    overrides.update({k: v for k, v in flags.items() if v is not None})
    return with_tokenizer_vocab(with_init_model(resolve_config(args.config, os.environ, overrides)))


def with_init_model(config: Config) -> Config:
    """``config`` with the model of its ``--init hf:DIR`` checkpoint, if it has one: the
    architecture, vocabulary and content hash (``model.checkpoint``) from the checkpoint's
    files, its tokenizer as ``data.tokenizer``. Every node reads the same files, so their
    fingerprints agree; ``[model]`` settings and another tokenizer are refused."""
    if not hf.is_hf(config.node.init_dir):
        return config
    init = config.node.init_dir
    ckpt = hf.read_checkpoint(hf.hf_dir(init))
    base = preset(config.swarm.model)
    changed = [f for f in vars(base) if getattr(base, f) != getattr(config.model, f)]
    if changed:
        raise ValueError(
            f"--init {init}: the model comes from the checkpoint; drop the model.{changed[0]} "
            "setting"
        )
    tokenizer = str(Path(ckpt.tokenizer).resolve())
    if config.data.tokenizer and Path(config.data.tokenizer).resolve() != Path(tokenizer):
        raise ValueError(
            f"--init {init}: data.tokenizer {config.data.tokenizer} is not the checkpoint's "
            f"tokenizer ({tokenizer}); leave data.tokenizer unset"
        )
    model, stages = ckpt.model, config.swarm.num_block_stages
    if model.num_blocks % stages:
        raise ValueError(
            f"--init {init}: the checkpoint's {model.num_blocks} layers cannot be split into "
            f"{stages} equal block stages; set swarm.num_block_stages to a divisor"
        )
    if config.data.seq_len > model.max_seq_len:
        raise ValueError(
            f"--init {init}: data.seq_len {config.data.seq_len} exceeds the checkpoint's "
            f"max_position_embeddings {model.max_seq_len}"
        )
    return replace(config, model=model, data=replace(config.data, tokenizer=tokenizer))


def with_tokenizer_vocab(config: Config) -> Config:
    """``config`` with ``model.vocab_size`` raised to the size of ``data.tokenizer``'s
    vocabulary (every node resolves it the same way, so fingerprints agree)."""
    vocab_size = model_vocab_size(config.data, config.model.vocab_size)
    if vocab_size == config.model.vocab_size:
        return config
    return replace(config, model=replace(config.model, vocab_size=vocab_size))


def _cmd_join(args: argparse.Namespace) -> int:
    if args.help_config:
        for key, default, doc in field_docs():
            print(f"{key} = {default}\n    {doc}")
        return 0
    config = join_config(args)
    if config.node.init_dir and not hf.is_hf(config.node.init_dir):  # hf: read just above
        check_init_dir(config.node.init_dir, config.model)  # a clear error before joining
    setup_logging(config.node.log_level)
    reuse_freed_memory(config.node.malloc_reuse)
    asyncio_run(_serve(config))
    return 0


async def _serve(config: Config) -> None:
    node = Node(config, identity=load_identity(config.node.state_dir))
    state = node.state
    set_context(
        lambda: f"{node.peer_id[:8]} s{state.stage} step {state.runner.step if state.runner else 0}"
    )
    loop = asyncio.get_running_loop()
    signals = 0

    def on_signal() -> None:
        nonlocal signals
        signals += 1
        if signals > 1:
            os._exit(130)  # second Ctrl-C: the user does not want to wait for the drain
        node.request_stop()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    try:
        await node.serve()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def asyncio_run(coro: Any) -> Any:
    """``asyncio.run`` on uvloop where installed (the one place the loop is chosen)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def _cmd_profile(args: argparse.Namespace) -> int:
    print(f"profiling {args.address} for {args.seconds:g}s ...", file=sys.stderr, flush=True)
    answer = post_to_node(
        args.address,
        "/profile",
        operator_auth(args.config),
        timeout_s=args.seconds + 60.0,
        query={"seconds": f"{args.seconds:g}"},
    )
    if args.json:
        print(json.dumps(answer, indent=2))
        return 0
    print(format_profile(answer, args.top))
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    st = fetch_status(args.address)
    if args.json:
        print(json.dumps(st, indent=2))
        return 0
    print(format_status(st))
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    return run_demo(args)


def _cmd_export(args: argparse.Namespace) -> int:
    status = fetch_status(args.address)
    overrides: dict[str, Any] = parse_sets(args.set)
    # The node's own split is the truth; model preset, overrides and seed come from the
    # given config and are checked against the node's fingerprint.
    overrides["swarm.num_block_stages"] = status["num_stages"] - 1
    if args.init is not None:
        if not hf.is_hf(args.init):
            raise ValueError(f"node export --init takes hf:DIR, not {args.init!r}")
        overrides["node.init_dir"] = args.init
    config = resolve_config(args.config, os.environ, overrides)
    config = with_tokenizer_vocab(with_init_model(config))
    info = export_model(
        status, config, args.out, timeout_s=args.timeout_s, format=args.format, dtype=args.dtype
    )
    for src in info.sources:
        print(
            f"stage {src['stage']}: step {src['step']} from {src['peer_id'][:8]} at {src['address']}"
        )
    what = "a Hugging Face Llama checkpoint, " + args.dtype if args.format == "hf" else "fp32"
    print(
        f"wrote {Path(args.out) / 'model.safetensors'} ({info.model.num_params():,} parameters, "
        f"fingerprint {info.fingerprint}; {what}) and config.json"
    )
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    model, tokenizer = load_model(args.model)
    text = generate(
        model,
        tokenizer,
        args.prompt,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
    )
    print(args.prompt + text)
    return 0
