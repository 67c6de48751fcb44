"""Why NoLoCo ends above data parallel in the convergence study: the diagnostic runs.

The study (``bench/convergence.py``, 4 replicas per stage, 5M tokens) finds NoLoCo 7.8 %
above data parallel where the NoLoCo paper reports the two level. Each variant here is one
``bench.convergence`` run of seed 0 that changes one thing, to tell apart what the gap
could be:

- how often replicas meet (``noloco_h10``, ``noloco_h25`` against the study's H = 50);
- gossip against averaging every replica's weights after every inner step
  (``average_every_step``: DiLoCo's all-reduce with H = 1, outer learning rate 1 and no
  momentum, so every replica holds the mean of the replicas' Adam steps at every step) or
  every 10 (``average_h10``, against NoLoCo's pairs and outer step at the same H);
- NoLoCo's outer step against its pairs (``pair_average_h10``: the NoLoCo rule with
  alpha = 0 and beta = gamma = 1, which sets each member of a pair to the pair's mean of
  ``theta``: plain averaging, in pairs), and the same every 50 and every 5 inner steps
  (``pair_average_h50``, ``pair_average_h5``; ``pair_average_h5_s1`` is seed 1, measured
  against the study's data parallel seed 1, ``pair_average_h5_s2`` seed 2 against
  ``dp_s2``, data parallel's seed 2, which the study does not hold;
  ``site_pair_average_h5`` the larger corpus, ``site_pair_average_h5_s1`` its seed 1
  against ``site_dp_s1``, and ``site_pair_average_h5_15m`` the larger corpus on 15M
  tokens against ``site_dp_15m``);
- a smaller step (``dp_half_lr``: data parallel at half the learning rate);
- the inner Adam's first-moment decay (``noloco_beta1_05`` against ``dp_beta1_05``: both
  at beta1 = 0.5 instead of 0.9; a NoLoCo replica's inner momentum outlives the outer step
  that resets its weights, and at beta1 = 0.9 it averages about 10 inner steps, a fifth of
  a round at H = 50);
- the budget (``noloco_15m`` against ``dp_15m``: three times the tokens, the schedule
  stretched to match; ``site_noloco_15m`` against ``site_dp_15m`` on the larger corpus,
  and their seeds 1 and 2, ``site_noloco_15m_s1`` against ``site_dp_15m_s1`` and
  ``site_noloco_15m_s2`` against ``site_dp_15m_s2``);
- the corpus (``site_noloco`` against ``site_dp``: the embedded corpus holds about 1.9M
  training tokens, so 5M tokens pass over it 2.7 times and 15M eight times; these two train
  on the docstrings of the installed packages, ``bench/site_corpus.py``, about 34M tokens,
  so 5M tokens see each head's shard 0.15 times);
- DiLoCo on the larger corpus, on a GPU (``gpu_site_diloco_5m`` and its seed 1
  ``gpu_site_diloco_5m_s1``, against data parallel on the same GPU, ``gpu_site_dp_5m`` and
  ``gpu_site_dp_5m_s1``, beside NoLoCo there, ``gpu_site_noloco_5m`` and
  ``gpu_site_noloco_5m_s1``): the same runs with ``node.device=cuda``, about five minutes
  each with three at once on one H100 against about 26 on two cores. A GPU rounds
  differently, so its runs are measured against data parallel on the GPU; set beside the
  CPU runs of the same seed they tell how far the two devices' figures agree.

``--run NAMES`` runs variants (each about 16 minutes with two at once on two cores; the
15M-token ones about 45) and keeps each one's ``convergence.json`` as
``results/convergence_gap/NAME.json``; without it the script only assembles what is there
into ``results/convergence_gap.json`` (every variant's final loss and its gap to data
parallel at each evaluation) and draws ``results/convergence_gap.png``. The 5M-token
variants are measured against the study's own data parallel run (seed 0, the same tokens,
schedule and data order).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
RUNS = RESULTS / "convergence_gap"
STUDY = RESULTS / "convergence.json"
SITE_CORPUS = Path(tempfile.gettempdir()) / "murmuration-site-corpus.jsonl"


@dataclass(frozen=True)
class Variant:
    label: str
    method: str
    args: tuple[str, ...]
    tokens: int = 5_000_000
    reference: str = "study"
    """What the gap is taken against: the study's data parallel run, or a variant's name."""
    site_corpus: bool = False
    """Trains on ``SITE_CORPUS`` (built first if missing) instead of the embedded corpus."""
    seed: int = 0
    """The seed of the run (data order and initial weights); its reference is the study's
    data parallel run of the same seed."""
    device: str = "cpu"
    """The torch device of every replica (``node.device``); a run on a GPU is measured only
    against data parallel on the same kind of device, since the two round differently."""


VARIANTS: dict[str, Variant] = {
    "noloco_h10": Variant("NoLoCo, H = 10", "noloco", ("--outer-steps", "10")),
    "noloco_h25": Variant("NoLoCo, H = 25", "noloco", ("--outer-steps", "25")),
    "average_every_step": Variant(
        "all 4 replicas' weights averaged after every inner step",
        "diloco",
        ("--set", "sync.outer_steps=1", "--set", "sync.diloco_lr=1.0")
        + ("--set", "sync.diloco_momentum=0"),
    ),
    "average_h10": Variant(
        "all 4 replicas' weights averaged every 10 inner steps",
        "diloco",
        ("--set", "sync.outer_steps=10", "--set", "sync.diloco_lr=1.0")
        + ("--set", "sync.diloco_momentum=0"),
    ),
    "pair_average_h10": Variant(
        "NoLoCo's pairs, weights averaged every 10 inner steps",
        "noloco",
        ("--outer-steps", "10", "--set", "sync.alpha=0", "--set", "sync.beta=1.0")
        + ("--set", "sync.gamma=1.0"),
    ),
    "pair_average_h50": Variant(
        "NoLoCo's pairs, weights averaged every 50 inner steps",
        "noloco",
        ("--set", "sync.alpha=0", "--set", "sync.beta=1.0", "--set", "sync.gamma=1.0"),
    ),
    "pair_average_h5": Variant(
        "NoLoCo's pairs, weights averaged every 5 inner steps",
        "noloco",
        ("--outer-steps", "5", "--set", "sync.alpha=0", "--set", "sync.beta=1.0")
        + ("--set", "sync.gamma=1.0"),
    ),
    "dp_half_lr": Variant(
        "data parallel, half the learning rate", "allreduce", ("--set", "train.lr=1e-3")
    ),
    "noloco_15m": Variant(
        "NoLoCo, H = 50, 15M tokens", "noloco", (), tokens=15_000_000, reference="dp_15m"
    ),
    "dp_15m": Variant(
        "data parallel, 15M tokens", "allreduce", (), tokens=15_000_000, reference="dp_15m"
    ),
    "noloco_beta1_05": Variant(
        "NoLoCo, H = 50, inner Adam beta1 0.5",
        "noloco",
        ("--set", "train.betas=0.5,0.999"),
        reference="dp_beta1_05",
    ),
    "dp_beta1_05": Variant(
        "data parallel, Adam beta1 0.5",
        "allreduce",
        ("--set", "train.betas=0.5,0.999"),
        reference="dp_beta1_05",
    ),
}
SITE = ("--set", f"data.path={SITE_CORPUS}")
VARIANTS["site_noloco"] = Variant(
    "NoLoCo, H = 50, a corpus of 34M tokens", "noloco", SITE, reference="site_dp", site_corpus=True
)
VARIANTS["site_pair_average_h5"] = Variant(
    "NoLoCo's pairs, weights averaged every 5 inner steps, a corpus of 34M tokens",
    "noloco",
    VARIANTS["pair_average_h5"].args + SITE,
    reference="site_dp",
    site_corpus=True,
)
VARIANTS["site_dp"] = Variant(
    "data parallel, a corpus of 34M tokens",
    "allreduce",
    SITE,
    reference="site_dp",
    site_corpus=True,
)
VARIANTS["dp_s2"] = Variant("data parallel (seed 2)", "allreduce", (), reference="dp_s2", seed=2)


def _other_seed(name: str, seed: int, reference: str) -> Variant:
    """Variant ``name`` run with ``seed``, measured against ``reference`` (data parallel of
    that seed on the same corpus)."""
    v = VARIANTS[name]
    return replace(v, label=f"{v.label} (seed {seed})", reference=reference, seed=seed)


VARIANTS["pair_average_h5_s1"] = _other_seed("pair_average_h5", 1, "study_s1")
VARIANTS["pair_average_h5_s2"] = _other_seed("pair_average_h5", 2, "dp_s2")
VARIANTS["site_dp_s1"] = _other_seed("site_dp", 1, "site_dp_s1")
VARIANTS["site_pair_average_h5_s1"] = _other_seed("site_pair_average_h5", 1, "site_dp_s1")


def _longer(name: str, tokens: int, reference: str) -> Variant:
    """Variant ``name`` on a budget of ``tokens`` (the schedule stretched to match),
    measured against ``reference`` (data parallel on that budget and corpus)."""
    v = VARIANTS[name]
    label = f"{v.label}, trained on {tokens / 1e6:g}M"
    return replace(v, label=label, tokens=tokens, reference=reference)


VARIANTS["site_dp_15m"] = _longer("site_dp", 15_000_000, "site_dp_15m")
VARIANTS["site_pair_average_h5_15m"] = _longer("site_pair_average_h5", 15_000_000, "site_dp_15m")
VARIANTS["site_noloco_15m"] = _longer("site_noloco", 15_000_000, "site_dp_15m")
VARIANTS["site_dp_15m_s1"] = _other_seed("site_dp_15m", 1, "site_dp_15m_s1")
VARIANTS["site_noloco_15m_s1"] = _other_seed("site_noloco_15m", 1, "site_dp_15m_s1")
VARIANTS["site_dp_15m_s2"] = _other_seed("site_dp_15m", 2, "site_dp_15m_s2")
VARIANTS["site_noloco_15m_s2"] = _other_seed("site_noloco_15m", 2, "site_dp_15m_s2")


def _on_gpu(name: str, tokens: int) -> Variant:
    """Variant ``name`` (one on the larger corpus) on one CUDA GPU with a budget of
    ``tokens`` (the schedule stretched to match), measured against data parallel on the
    larger corpus on the GPU with the same budget."""
    v = VARIANTS[name]
    label = f"{v.label}, trained on {tokens / 1e6:g}M on a GPU"
    reference = f"gpu_site_dp_{tokens // 1_000_000}m"
    return replace(v, label=label, tokens=tokens, reference=reference, device="cuda")


VARIANTS["site_diloco"] = Variant(
    "DiLoCo, H = 50, a corpus of 34M tokens", "diloco", SITE, reference="site_dp", site_corpus=True
)
for _name in ("site_dp", "site_noloco", "site_diloco"):
    _v = _on_gpu(_name, 5_000_000)
    VARIANTS[f"gpu_{_name}_5m"] = _v
    VARIANTS[f"gpu_{_name}_5m_s1"] = replace(
        _v, label=f"{_v.label} (seed 1)", seed=1, reference="gpu_site_dp_5m_s1"
    )
STUDY_CURVES = {  # the study's seed-0 runs shown beside the variants
    "noloco": "NoLoCo, H = 50 (the study)",
    "diloco": "DiLoCo, H = 50 (the study)",
    "none": "independent replicas (the study)",
}


def log(msg: str) -> None:
    print(f"[convergence_gap {time.strftime('%X')}] {msg}", file=sys.stderr, flush=True)


def run(name: str, threads: int) -> None:
    """One variant through ``bench.convergence``, kept as ``RUNS/name.json``."""
    from bench import convergence

    v = VARIANTS[name]
    if v.site_corpus and not SITE_CORPUS.exists():
        from bench import site_corpus

        site_corpus.main([str(SITE_CORPUS)])
    with tempfile.TemporaryDirectory() as tmp:
        argv = ["--tokens", str(v.tokens), "--seeds", str(v.seed), "--replicas", "4"]
        argv += ["--methods", v.method, "--threads", str(threads), "--out", tmp, *v.args]
        if v.device != "cpu":
            argv += ["--set", f"node.device={v.device}"]
        log(f"{name}: bench.convergence {' '.join(argv)}")
        convergence.main(argv)
        RUNS.mkdir(parents=True, exist_ok=True)
        shutil.copy(Path(tmp) / "convergence.json", RUNS / f"{name}.json")


def _curve(result: dict[str, Any], method: str, seed: int = 0) -> dict[str, Any]:
    curves = result["methods"][method]["curves"]
    curve: dict[str, Any] = next(c for c in curves if c["seed"] == seed)
    return curve


def gaps(curve: dict[str, Any], reference: dict[str, Any]) -> list[float | None]:
    """``curve``'s eval loss over ``reference``'s at the same tokens, minus one (None where
    the reference has no evaluation at that count)."""
    at = dict(zip(reference["tokens"], reference["eval_loss"], strict=True))
    return [
        round(loss / at[t] - 1.0, 4) if t in at and t else None
        for t, loss in zip(curve["tokens"], curve["eval_loss"], strict=True)
    ]


def assemble() -> dict[str, Any]:
    study = json.loads(STUDY.read_text())
    dp = _curve(study, "allreduce")
    curves: dict[str, tuple[str, dict[str, Any]]] = {
        f"study_{m}": (label, _curve(study, m)) for m, label in STUDY_CURVES.items()
    }
    references: dict[str, dict[str, Any]] = {"study": dp, "study_s1": _curve(study, "allreduce", 1)}
    for name, v in VARIANTS.items():
        path = RUNS / f"{name}.json"
        if path.exists():
            curve = _curve(json.loads(path.read_text()), v.method, v.seed)
            curves[name] = (v.label, curve)
            references[name] = curve
    out: dict[str, Any] = {
        "seed": 0,
        "replicas_per_stage": study["replicas_per_stage"],
        "reference": "data parallel of the same seed: the study's runs at 5M tokens, dp_15m at "
        "15M, site_dp on the larger corpus",
        "variants": {},
    }
    for name, (label, curve) in curves.items():
        ref_name = VARIANTS[name].reference if name in VARIANTS else "study"
        if ref_name not in references:
            log(f"{name}: no {ref_name} run yet, left out")
            continue
        g = gaps(curve, references[ref_name])
        out["variants"][name] = {
            "label": label,
            "against": ref_name,
            "tokens": curve["tokens"],
            "eval_loss": curve["eval_loss"],
            "gap_to_dp": g,
            "final_eval_loss": curve["eval_loss"][-1],
            "final_gap_to_dp": g[-1],
            "final_spread": curve["spread"][-1],
        }
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # the legends sit under the panels, one line a curve: the figure grows with the longer
    curves = [v["against"] for n, v in result["variants"].items() if n != v["against"]]
    left = curves.count("study")
    right = len(curves) - left + 1  # and the study's NoLoCo, drawn on both
    legend_in = 0.19 * max(left, right) + 0.3
    fig, axes = plt.subplots(1, 2, figsize=(15, 6.5 + legend_in))
    for ax in axes:
        ax.set_prop_cycle(color=[plt.get_cmap("tab20")(i) for i in range(20)])
    for name, v in result["variants"].items():
        ax = axes[1] if v["against"] != "study" else axes[0]
        if name == v["against"]:  # a reference against itself
            continue
        xs = [t / 1e6 for t, g in zip(v["tokens"], v["gap_to_dp"], strict=True) if g is not None]
        ys = [100 * g for g in v["gap_to_dp"] if g is not None]
        style = "--" if name.startswith("study_") else "-"
        ax.plot(xs, ys, style, marker="o", ms=3, label=v["label"])
        if name == "study_noloco":  # the same curve on the right, for the two budgets
            axes[1].plot(xs, ys, style, marker="o", ms=3, label=v["label"] + ", 5M budget")
    for ax, title in zip(
        axes,
        (
            "what changes the gap (5M tokens, seed 0)",
            "against data parallel on the same budget, corpus and seed",
        ),
        strict=True,
    ):
        ax.axhline(0, color="black", lw=0.8)
        ax.axhline(2, color="grey", lw=0.8, ls=":")
        ax.set_xlabel("tokens (millions)")
        ax.set_ylabel("eval loss above data parallel (%)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=1)
    height = 6.5 + legend_in
    fig.subplots_adjust(
        left=0.06, right=0.98, top=1 - 0.4 / height, bottom=(legend_in + 0.6) / height, wspace=0.25
    )
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run", default="", help=f"variants to run first: {','.join(VARIANTS)}")
    p.add_argument("--threads", type=int, default=2, help="torch threads of each run")
    args = p.parse_args(argv)
    for name in filter(None, args.run.split(",")):
        if name not in VARIANTS:
            raise SystemExit(f"unknown variant {name!r}; known: {', '.join(VARIANTS)}")
        run(name, args.threads)
    result = assemble()
    (RESULTS / "convergence_gap.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, RESULTS / "convergence_gap.png")
    for name, v in result["variants"].items():
        log(f"{name}: {v['final_eval_loss']:.4f}, {100 * v['final_gap_to_dp']:+.1f} % over DP")
    return result


if __name__ == "__main__":
    main()
