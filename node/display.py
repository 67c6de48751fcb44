"""What ``node status`` and ``node profile`` print: a node's answers as text for a person.

Owns the layout of those two commands' output; the data comes from the node as JSON
(``node.client``). No I/O here.
"""

from __future__ import annotations

from typing import Any


def format_status(st: dict[str, Any]) -> str:
    role = "head" if st["stage"] == 0 else f"block stage {st['stage']}"
    if st.get("relay_only"):
        role = "relay (no stage)"
    lines = [
        f"node {st['peer_id']} at {st['address']}  swarm {st['swarm']} ({st['fingerprint']})",
        f"  {role} of {st['num_stages']} stages, "
        f"{'ready' if st['ready'] or st.get('relay_only') else 'joining'}"
        f"{', leaving' if st['leaving'] else ''}, up {st['uptime_s']:.0f}s",
        f"  step {st['step']}, {st['samples']} samples, {st['throughput']:.1f} samples/s, queue {st['queue']}",
    ]
    if st["stage"] >= 0 and "lr" in st:
        place = st.get("schedule_step", st["step"])
        lines[-1] += f", learning rate {st['lr']:.3g}" + (
            f" (the stage's place in its schedule: step {place:.0f})"
            if abs(place - st["step"]) >= 1
            else ""
        )
    reach = st.get("reachability")
    if reach:
        lines.append(f"  reachability: {reach['state']} ({reach['detail']})")
        if reach.get("advice"):
            lines.append(f"    {reach['advice']}")
    swarm_time = st.get("swarm_time")
    if swarm_time and swarm_time["offset_s"]:
        offset = swarm_time["offset_s"]
        lines.append(
            f"  this machine's clock is {abs(offset):.0f}s {'behind' if offset > 0 else 'ahead of'}"
            f" the swarm's: proofs carry the swarm's time (set the clock: timedatectl set-ntp true)"
        )
    tcp = st.get("tcp_congestion")
    if tcp and tcp["wanted"] and not tcp["active"]:
        paced = tcp.get("pacing")
        lines.append(
            f"  TCP congestion control {tcp['wanted']} not available ({tcp['why']}): "
            + (
                "the node paces its uploads itself"
                if paced
                else "on a thin uplink small messages may wait behind uploads"
            )
            + " (see the log for how to allow it)"
        )
    pacing = (tcp or {}).get("pacing")
    if pacing and pacing["pacing"]:
        lines.append(
            f"  uploads paced at {pacing['pace_bytes_per_s'] * 8 / 1e6:.1f} Mbit/s (uplink "
            f"measured {pacing['capacity_bytes_per_s'] * 8 / 1e6:.1f} Mbit/s, queue "
            f"{pacing['queueing_ms']:.0f} ms)"
        )
    relay = st.get("relay")
    if relay and relay.get("nodes"):
        moved = sum(relay.get("bytes", {}).values()) / 1e6
        lines.append(
            f"  relaying for {len(relay['nodes'])} of up to {relay['capacity']} nodes "
            f"that cannot be dialled ({moved:.1f} MB so far)"
        )
    if st["stage"] >= 0 and st["ready"]:
        lines.append(_thermometers(st))
    loop = st.get("loop")
    if loop and loop["stalls"]:
        lines.append(
            f"  event loop held up {loop['stalls']} time(s), longest {loop['longest_s']:.1f} s: "
            "the node answered nothing meanwhile (its log says where)"
        )
    wire = st.get("wire")
    if wire and st["stage"] >= 0:
        how = ""
        if wire["auto"]:
            link = wire.get("link_mbps")
            how = " (auto)" if link is None else f" (auto: payloads arrive at {link:.1f} Mbit/s)"
        lines.append(f"  wire codec {wire['codec']}{how}")
        if wire.get("too_thin"):
            lines.append(
                f"  uplink too thin: one tensor takes {wire['send_s']:.1f} s to send, and two "
                "in flight miss a hop's deadline (peers time out and re-issue its work)"
            )
    if st["stage"] == 0:
        loss = "-" if st.get("loss") is None else f"{st['loss']:.3f}"
        ev = "-" if st.get("eval_loss") is None else f"{st['eval_loss']:.3f}"
        lines.append(
            f"  loss {loss}, eval loss {ev}, {st['tokens']} tokens, {st['tokens_per_s']:.0f} tokens/s"
        )
        window = st.get("window")
        if window:
            trip = window.get("base_rtt_ms")
            lines.append(
                f"  in flight {st.get('in_flight', 0)} of a {window['policy']} window of "
                f"{window['size']}"
                + ("" if trip is None else f" (round trip {trip:.0f} ms with nothing queued)")
            )
    sync = st.get("sync")
    if sync:
        rounds = ", ".join(f"{k} {v}" for k, v in sorted(sync["rounds"].items())) or "none yet"
        per = sync["seconds_sum"] / sync["seconds_count"] if sync["seconds_count"] else 0.0
        spread = "-" if sync.get("spread_rms") is None else f"{sync['spread_rms']:.2e}"
        every = f" every {sync['round_s']:g}s" if sync.get("round_s") else ""
        if (multiple := sync.get("round_multiple") or 1) > 1:
            every += f" ({multiple} of the stage's rounds: its exchange outlasts one)"
        offset = sync.get("clock_offset_s") or 0.0
        if abs(offset) >= 1.0:
            every += f" of the stage's clock ({offset:+.1f}s from this machine's)"
        if sync.get("clock_restarts"):
            every += f", restarted {sync['clock_restarts']}x after the clock was set back"
        own, peers = (st.get("counters", {}).get(k, 0) for k in ("clock_steps", "peer_clock_steps"))
        if own or peers:
            every += f"; clocks seen set: this machine's {own}x, peers' {peers}x"
        lines.append(
            f"  sync {sync['method']}{every}: {sync['outer_steps']} outer steps ({rounds}), "
            f"{per:.2f}s per round, spread to last partner {spread}, "
            f"{sync['bytes_sent'] / 1e6:.1f} MB sent, {sync['bytes_received'] / 1e6:.1f} MB received"
        )
        if sync.get("uplink_too_thin"):
            send_s, given_s = sync["contribution_send_s"], sync["contribution_given_s"]
            round_s, exchange_s = (
                sync.get("contribution_round_s"),
                sync.get("contribution_exchange_s"),
            )
            late = (
                f"a partner waits {given_s:.0f} s"
                if send_s > given_s or not round_s or exchange_s is None
                else f"an exchange takes about {exchange_s:.0f} s of a {round_s:.0f} s round"
            )
            lines.append(
                f"  uplink too thin to gossip: a contribution takes {send_s:.0f} s to send and "
                f"{late} (rounds end solo; sync.codec = auto, or a higher "
                "sync.max_upload_wait_s and longer sync.round_s, would fit)"
            )
    bal = st.get("balance")
    if bal:
        plan = bal.get("plan")
        lines.append(
            f"  balance {bal['policy']}: own block speed {bal['own_block_rate']:.1f} samples/s, "
            f"{'movable' if bal['movable'] else 'pinned'}, {bal['moves']} move(s)"
            + (f", {bal['yielded']} given up to another's" if bal.get("yielded") else "")
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
                + (
                    "  <- left out of hops: far slower (train.route_cutoff)"
                    if p.get("left_out")
                    else ""
                )
            )
    far = {k: v for k, v in st.get("stages", {}).items() if not v["held"]}
    for stage, summary in sorted(far.items(), key=lambda kv: int(kv[0])):
        lines.append(
            f"    stage {stage}: {summary['replicas']} replica(s), {summary['ready']} ready, "
            f"{summary['throughput']:.1f} samples/s in all (a peer's summary, "
            f"{summary['age_s']:.0f}s old)" + ("" if summary["ready"] else "  <- none")
        )
    return "\n".join(lines)


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


def _thermometers(st: dict[str, Any]) -> str:
    """YaLM's thermometers of the node's stage, one line."""
    logits = st.get("attn_logit_max") or {}
    top = f", max attention logit {max(logits.values()):.1f}" if logits else ""
    skipped = st.get("steps_skipped", 0)
    delay = st.get("grad_delay_steps", 0.0)
    scale = st.get("lr_scale", 1.0)
    return (
        f"  thermometers: grad norm {st.get('grad_norm_preclip', 0.0):.3g} before clipping, "
        f"activations [{st['act_min']:.3g}, {st['act_max']:.3g}]{top}"
        + (f", gradients {delay:.1f} steps late" if delay else "")
        + (f", {skipped} step(s) skipped as spikes" if skipped else "")
        + (f", learning rate x{scale:g}" if scale != 1.0 else "")
    )
