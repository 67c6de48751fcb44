"""Command line: ``node join``, ``status``, ``profile``, ``demo``, ``export``, ``generate``
(also ``murmur``).

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
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from node.config import Config, field_docs, resolve_config

if TYPE_CHECKING:
    from protocol.auth import SwarmAuth


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

    j = sub.add_parser("join", help="run a daemon that serves one stage of the swarm's model")
    j.add_argument(
        "--stage",
        help="'auto' (default: an empty stage, else the weakest by throughput; may move "
        "later to balance the swarm) or K (0 = head; never rebalanced)",
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
        choices=["noloco", "diloco", "allreduce", "none"],
        help="how replicas of a stage stay together (default noloco)",
    )
    j.add_argument(
        "--recovery",
        choices=["checkfree", "checkfree+", "checkpoint", "random"],
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
        help="start a stage with no live replica from this exported model (node export)",
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

    s = sub.add_parser("status", help="show a running node's view of the swarm")
    s.add_argument("address", metavar="ADDRESS", help="HOST:PORT of the node")
    s.add_argument("--json", action="store_true", help="print the raw JSON")
    s.set_defaults(func=_cmd_status)

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
    e.set_defaults(func=_cmd_export)

    g = sub.add_parser("generate", help="sample text from an exported model (no swarm needed)")
    g.add_argument("--model", required=True, metavar="DIR", help="directory written by node export")
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
    return p


def parse_sets(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or "." not in key:
            raise ValueError(f"--set expects SECTION.FIELD=VALUE, got {item!r}")
        out[key.strip()] = value.strip()
    return out


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
    return with_tokenizer_vocab(resolve_config(args.config, os.environ, overrides))


def with_tokenizer_vocab(config: Config) -> Config:
    """``config`` with ``model.vocab_size`` raised to the size of ``data.tokenizer``'s
    vocabulary (every node resolves it the same way, so fingerprints agree)."""
    from node.data.dataset import model_vocab_size

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
    if config.node.init_dir:
        from node.stage.export import check_init_dir

        check_init_dir(config.node.init_dir, config.model)  # a clear error before joining
    from node.allocator import reuse_freed_memory
    from node.logs import setup_logging

    setup_logging(config.node.log_level)
    reuse_freed_memory()
    asyncio_run(_serve(config))
    return 0


async def _serve(config: Config) -> None:
    from node.daemon import Node
    from node.identity import load_identity
    from node.logs import set_context

    node = Node(config, identity=load_identity(config.node.state_dir))
    set_context(
        lambda: f"{node.peer_id[:8]} s{node.stage} step {node.runner.step if node.runner else 0}"
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


def fetch_status(address: str, timeout_s: float = 5.0) -> dict[str, Any]:
    url = address if address.startswith("http") else f"http://{address}"
    try:
        with urllib.request.urlopen(f"{url}/status", timeout=timeout_s) as resp:
            data: dict[str, Any] = json.loads(resp.read())
            return data
    except (urllib.error.URLError, OSError) as e:
        raise ValueError(f"cannot reach a node at {address}: {e}") from None


class NodeRefused(ValueError):
    """A node answered an operator request with an error: its HTTP status and message."""

    def __init__(self, address: str, status: int, message: str) -> None:
        super().__init__(f"{address} refused the request ({status}): {message}")
        self.status = status


def post_to_node(
    address: str,
    path: str,
    auth: SwarmAuth | None = None,
    timeout_s: float = 120.0,
    query: dict[str, str] | None = None,
) -> dict[str, Any]:
    """POST an empty body to one of a node's operator endpoints (``/eval``, ``/profile``)
    and return its JSON answer; a keyed swarm's node wants ``auth``'s proof over the body.
    Raises NodeRefused with the node's own error, ValueError when it cannot be reached."""
    headers: dict[str, str] = {}
    if auth is not None:
        from protocol.auth import AUTH_HEADER, frame_digest

        sent = auth.sign_request(address, "POST", path, frame_digest([]), time.time())
        headers[AUTH_HEADER] = sent.header
    url = f"http://{address}{path}" + (f"?{urllib.parse.urlencode(query)}" if query else "")
    req = urllib.request.Request(url, method="POST", data=b"", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            answer: dict[str, Any] = json.loads(resp.read())
            return answer
    except urllib.error.HTTPError as e:
        try:
            message = str(json.loads(e.read())["error"])
        except (ValueError, KeyError, TypeError):
            message = str(e.reason)
        raise NodeRefused(address, e.code, message) from None
    except (urllib.error.URLError, OSError) as e:
        raise ValueError(f"cannot reach a node at {address}: {e}") from None


def operator_auth(
    config_path: str | None, settings: dict[str, str] | None = None
) -> SwarmAuth | None:
    """The operator's side of a keyed swarm (a fresh identity) from the config, environment
    and ``settings``, or None for an open swarm."""
    from node.identity import swarm_auth
    from protocol.auth import Identity

    net = resolve_config(config_path, os.environ, settings or {}).net
    return swarm_auth(net, Identity.generate())


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


def format_profile(p: dict[str, Any], top: int) -> str:
    """A profile's summary: the compute thread's CPU by phase, then the costliest operators."""
    cpu = p["thread_cpu_s"]
    role = "head" if p["stage"] == 0 else f"block stage {p['stage']}"
    lines = [
        f"node {p['peer_id']}, {role}: {p['wall_s']:.1f}s profiled, {p['samples']} samples, "
        f"compute thread {cpu:.2f}s CPU ({p['runqueue_wait_s']:.2f}s more waiting for a core)",
    ]
    for phase, s in p["phases_cpu_s"].items():
        lines.append(f"  {phase:<18} {s:8.3f}s  {100 * s / cpu if cpu else 0:5.1f} %")
    lines.append(f"  {'operator':<52} {'calls':>8} {'self CPU s':>11} {'share':>7}")
    for op in p["ops"][:top]:
        share = 100 * op["self_cpu_s"] / cpu if cpu else 0.0
        lines.append(
            f"  {op['op'][:52]:<52} {op['calls']:>8} {op['self_cpu_s']:>11.3f} {share:>6.1f}%"
        )
    return "\n".join(lines)


def _cmd_status(args: argparse.Namespace) -> int:
    st = fetch_status(args.address)
    if args.json:
        print(json.dumps(st, indent=2))
        return 0
    print(format_status(st))
    return 0


def format_status(st: dict[str, Any]) -> str:
    role = "head" if st["stage"] == 0 else f"block stage {st['stage']}"
    lines = [
        f"node {st['peer_id']} at {st['address']}  swarm {st['swarm']} ({st['fingerprint']})",
        f"  {role} of {st['num_stages']} stages, {'ready' if st['ready'] else 'joining'}"
        f"{', leaving' if st['leaving'] else ''}, up {st['uptime_s']:.0f}s",
        f"  step {st['step']}, {st['samples']} samples, {st['throughput']:.1f} samples/s, queue {st['queue']}",
    ]
    if st["stage"] == 0:
        loss = "-" if st.get("loss") is None else f"{st['loss']:.3f}"
        ev = "-" if st.get("eval_loss") is None else f"{st['eval_loss']:.3f}"
        lines.append(
            f"  loss {loss}, eval loss {ev}, {st['tokens']} tokens, {st['tokens_per_s']:.0f} tokens/s"
        )
    sync = st.get("sync")
    if sync:
        rounds = ", ".join(f"{k} {v}" for k, v in sorted(sync["rounds"].items())) or "none yet"
        per = sync["seconds_sum"] / sync["seconds_count"] if sync["seconds_count"] else 0.0
        spread = "-" if sync.get("spread_rms") is None else f"{sync['spread_rms']:.2e}"
        lines.append(
            f"  sync {sync['method']}: {sync['outer_steps']} outer steps ({rounds}), "
            f"{per:.2f}s per round, spread to last partner {spread}, "
            f"{sync['bytes_sent'] / 1e6:.1f} MB sent, {sync['bytes_received'] / 1e6:.1f} MB received"
        )
    bal = st.get("balance")
    if bal:
        plan = bal.get("plan")
        lines.append(
            f"  balance {bal['policy']}: own block speed {bal['own_block_rate']:.1f} samples/s, "
            f"{'movable' if bal['movable'] else 'pinned'}, {bal['moves']} move(s)"
            + (
                f", planned: {plan['peer_id'][:8]} {plan['source']}->{plan['target']}"
                if plan
                else ""
            )
        )
    lines.append("  peers:")
    for stage, peers in sorted(st["peers"].items(), key=lambda kv: int(kv[0])):
        if int(stage) < 0:
            continue
        total = sum(p["throughput"] for p in peers if p["ready"])
        if int(stage) == st["stage"] and st["ready"]:
            total += st["throughput"]
        lines.append(
            f"    stage {stage}: {len(peers)} peer(s), {total:.1f} samples/s in all"
            + ("" if peers else "  <- none")
        )
        for p in peers:
            lines.append(
                f"      {p['peer_id']}  {p['address']:<21} step {p['step']:<6} "
                f"{p['throughput']:>7.1f}/s  queue {p['queue']}  seen {p['age_s']:.1f}s ago"
            )
    return "\n".join(lines)


def _cmd_demo(args: argparse.Namespace) -> int:
    from node.demo import run_demo

    return run_demo(args)


def _cmd_export(args: argparse.Namespace) -> int:
    from node.stage.export import export_model

    status = fetch_status(args.address)
    overrides: dict[str, Any] = parse_sets(args.set)
    # The node's own split is the truth; model preset, overrides and seed come from the
    # given config and are checked against the node's fingerprint.
    overrides["swarm.num_block_stages"] = status["num_stages"] - 1
    config = with_tokenizer_vocab(resolve_config(args.config, os.environ, overrides))
    info = export_model(status, config, args.out, timeout_s=args.timeout_s)
    for src in info.sources:
        print(
            f"stage {src['stage']}: step {src['step']} from {src['peer_id'][:8]} at {src['address']}"
        )
    print(
        f"wrote {Path(args.out) / 'model.safetensors'} ({info.model.num_params():,} parameters, "
        f"fingerprint {info.fingerprint}) and config.json"
    )
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from node.stage.export import generate, load_export, load_export_tokenizer

    model, info = load_export(args.model)
    tokenizer = load_export_tokenizer(args.model, info)
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
