"""Train a small DSA language model with hyscale-core's engine, no DL framework.

The task (hyscale_core.engine.needle): 512-token sequences of filler with a
few "fact" tokens in the first half, each binding a key to a value; the last
tokens name keys, and the model must answer with their values. The needle
sits hundreds of tokens back, and the sparse attention sees only the
top-16 keys the lightning indexer selects, so the indexer has to learn to
find it.

Training follows DSA's two stages:

1. dense warm-up: short sequences (64 tokens) with top-k = the whole
   context, so the attention learns to retrieve and the indexer learns, from
   the KL loss, to score what the attention reads;
2. sparse: the full-length sequences with top-k = 16.

The loss lives only at the query tokens, so the indexer's KL loss is taken
there too (``kl_on_loss_rows``): elsewhere the attention has nothing to
learn and its pattern is noise the indexer need not imitate.

Every step checkpoints each block: the forward keeps the block input and
its selection; the backward recomputes the block with the selection
replayed (never running the indexer top-k again). Evaluation runs the
sparse setting (512 tokens, top-16) throughout: its loss falls and the
indexer's recall of the needle (how often the fact a query asks about is
among its selected keys) rises.

    python examples/train_tiny_dsa.py                 # CPU (GPU when CuPy sees one)
    python examples/train_tiny_dsa.py --quick         # a few seconds, a smoke run
    python examples/train_tiny_dsa.py --log rollout.h5   # + the trained indexer's selections
    mpiexec -n 2 python examples/train_tiny_dsa.py --quick   # every sequence sharded over 2 ranks

Under ``mpiexec -n P`` (P > 1) every rank draws the same batches and runs
its shard of each (hyscale_core.mpi's ShardedRunner: zigzag layout per
sequence or over the packed row, exact selection, parameter gradients
summed over ranks in a fixed order), so every rank holds the
same parameters after each step and the losses are one process's up to
float32 rounding. Rank 0 alone prints and writes.

Writes OUT/history.json, OUT/params.npz, OUT/config.json and OUT/curves.png (the plot needs
matplotlib: pip install "hyscale-core[plot]").
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

import hyscale_core as hs
from hyscale_core._backend import cupy_module, to_host
from hyscale_core.engine import AdamW, DSAConfig, LiveSelection, TinyDSA, backward, no_grad
from hyscale_core.engine.needle import NeedleTask, needle_recall
from hyscale_core.ops.indexer import MAX_TOPK
from hyscale_core.mpi import abort_on_error, launched_world, use_local_gpu
from hyscale_core.mpi.engine import ShardedRunner


# --quick's sizes: defaults only, so an option given on the command line still wins.
QUICK = {"steps": 6, "warmup_steps": 3, "length": 64, "warmup_length": 32, "tokens": 256, "eval_every": 3,
         "eval_sequences": 4, "topk": 8, "log_samples": 2, "log_sequences": 4}
# The least value of each int option (--length and the top-k options are checked on their own).
LEAST = {"steps": 0, "warmup_steps": 0, "layers": 1, "seed": 0, "eval_every": 1, "eval_sequences": 1,
         "log_samples": 1, "log_sequences": 1}


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300, help="training steps in all")
    p.add_argument("--warmup-steps", type=int, default=200,
                   help="dense warm-up steps (the first ones; at most --steps)")
    p.add_argument("--length", type=int, default=512, help="sequence length of the sparse stage and eval")
    p.add_argument("--warmup-length", type=int, default=64, help="sequence length of the dense warm-up")
    p.add_argument("--topk", type=int, default=16, help="keys each query attends to (sparse stage, eval)")
    p.add_argument("--tokens", type=int, default=4096,
                   help="tokens per step: --tokens // (the stage's length) sequences, packed")
    p.add_argument("--layers", type=int, default=1, help="DSA blocks (1 learns fastest on 2 CPU cores)")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--eval-sequences", type=int, default=32)
    p.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto")
    p.add_argument("--out", type=Path, default=Path("tiny_dsa_out"), help="folder for history, params, plot")
    p.add_argument("--log", type=Path, help="write the trained model's selections to this HDF5 SelectionLog")
    p.add_argument("--log-append", action="store_true",
                   help="add to an existing log instead of replacing it (samples are named by seed)")
    p.add_argument("--log-samples", type=int, default=4, help="rollout samples in the log")
    p.add_argument("--log-sequences", type=int, default=16, help="sequences packed in one logged sample")
    p.add_argument("--log-length", type=int, help="sequence length of the rollout (default --length)")
    p.add_argument("--log-topk", type=int, help="top-k of the rollout (default --topk)")
    p.add_argument("--load", type=Path, help="start from these parameters (a params.npz this program wrote)")
    p.add_argument("--quick", action="store_true",
                   help="tiny sizes and a few steps (a smoke test); options given as well still apply")
    return p


def parse(argv=None) -> argparse.Namespace:
    """The options, their values checked against argv alone: a bad one is a usage
    error (exit 2) here, the same on every rank, before MPI starts. The files
    are checked by :func:`refuse_path_problems` once the ranks can agree."""
    p = make_parser()
    if p.parse_known_args(argv)[0].quick:
        p.set_defaults(**QUICK)
    args = p.parse_args(argv)
    args.log_length = args.length if args.log_length is None else args.log_length
    args.log_topk = args.topk if args.log_topk is None else args.log_topk
    try:
        check_args(args)
    except ValueError as e:
        p.error(str(e))
    args.warmup_steps = min(args.warmup_steps, args.steps)
    return args


def check_args(args: argparse.Namespace) -> None:
    """ValueError naming the option for a value the run cannot use, or would
    silently replace."""
    for name, least in LEAST.items():
        if getattr(args, name) < least:
            raise ValueError(f"{_option(name)} must be >= {least}, got {getattr(args, name)}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise ValueError(f"--lr must be finite and > 0, got {args.lr}")
    for name in ("topk", "log_topk"):
        if not 1 <= getattr(args, name) <= MAX_TOPK:
            raise ValueError(f"{_option(name)} must be in [1, {MAX_TOPK}], got {getattr(args, name)}")
    for name in ("length", "warmup_length", "log_length"):
        try:
            NeedleTask(length=getattr(args, name))
        except ValueError as e:
            raise ValueError(f"{_option(name)} {getattr(args, name)}: {e}") from None
    dense = min(args.warmup_steps, args.steps)
    for name, steps in (("warmup_length", dense), ("length", args.steps - dense)):
        if steps and args.tokens < getattr(args, name):
            raise ValueError(f"--tokens {args.tokens} holds no whole sequence of {_option(name)} "
                             f"{getattr(args, name)} (a step packs --tokens // length sequences)")
    if args.log_append and args.log is None:
        raise ValueError("--log-append needs --log")


def refuse_path_problems(args: argparse.Namespace, world=None) -> None:
    """Before any training: if a rank finds a :func:`path_problem`, every rank
    exits with the first one as a usage error (status 2). Under mpiexec the
    ranks agree first (a file may exist on one host only), so none is left
    waiting for a rank that quit."""
    if world is None:
        problems = [path_problem(args, lead=True)]
    else:
        problems = world.allgather(path_problem(args, lead=world.Get_rank() == 0))
    problem = next((p for p in problems if p), None)
    if problem:
        make_parser().error(problem)


def path_problem(args: argparse.Namespace, lead: bool) -> str | None:
    """Why the files cannot be used (None: they can): --load must exist; on the
    lead rank, which writes them, --out must be a folder or nothing yet (it is
    made), --log must lie in a folder or in --out and, with --log-append, hold
    none of this rollout's samples."""
    try:
        if args.load is not None and not args.load.is_file():
            raise ValueError(f"--load {args.load}: no such file")
        if lead:
            check_outputs(args)
    except ValueError as e:
        return str(e)
    return None


def check_outputs(args: argparse.Namespace) -> None:
    if args.out.exists() and not args.out.is_dir():
        raise ValueError(f"--out {args.out} exists and is not a folder")
    if args.log is None:
        return
    if not (args.log.parent.is_dir() or args.log.parent.resolve() == args.out.resolve()):  # --out: made first
        raise ValueError(f"--log {args.log}: no folder {args.log.parent}")
    if args.log.is_dir():
        raise ValueError(f"--log {args.log} is a folder")
    if args.log_append and args.log.exists():
        taken = sorted(set(sample_names(args)) & set(_logged_samples(args.log)))
        if taken:
            raise ValueError(f"--log-append: {args.log} already holds samples {', '.join(taken)} "
                             f"(samples are named by length, top-k and seed: another --seed adds new ones)")


def _logged_samples(path: Path) -> list[str]:
    from hyscale_core.io import SelectionLog, SelectionLogError

    try:
        with SelectionLog(path) as log:
            return log.samples()
    except (SelectionLogError, OSError) as e:
        raise ValueError(f"--log-append: {path} cannot be read as a SelectionLog ({e})") from None


def sample_names(args: argparse.Namespace) -> list[str]:
    """The rollout's sample names in the log."""
    return [f"L{args.log_length}-top{args.log_topk}-seed{args.seed}-{i}" for i in range(args.log_samples)]


def _option(name: str) -> str:
    return "--" + name.replace("_", "-")


def array_module(device: str):
    cp = cupy_module()
    if device == "gpu" and cp is None:
        sys.exit("--device gpu: CuPy sees no CUDA device")
    return cp if device != "cpu" and cp is not None else np


class Progress:
    """A plain-text progress bar: redrawn in place on a terminal, a line per
    ``every`` steps otherwise (logs stay readable)."""

    def __init__(self, total: int, every: int, width: int = 28, quiet: bool = False) -> None:
        self.total, self.every, self.width, self.quiet = total, max(1, every), width, quiet
        self.start, self.tty = time.perf_counter(), sys.stdout.isatty()

    def update(self, done: int, note: str) -> None:
        if self.quiet:
            return
        elapsed = time.perf_counter() - self.start
        eta = elapsed / done * (self.total - done)
        filled = self.width * done // self.total
        line = (f"[{'#' * filled}{'.' * (self.width - filled)}] {done:4d}/{self.total} "
                f"{elapsed:5.0f}s elapsed, {eta:4.0f}s left  {note}")
        if self.tty:
            print("\r" + line, end="", flush=True)
        elif done % self.every == 0 or done == self.total:
            print(line, flush=True)

    def message(self, text: str) -> None:
        if not self.quiet:
            print(("\n" if self.tty else "") + text, flush=True)


def run_model(model, batch, topk, xp, train=False, runner=None):
    """One forward (and, when ``train``, a backward with the blocks checkpointed and
    their selections replayed) on a NeedleBatch; returns (output, selections by layer).
    ``runner`` (under mpiexec): the sequence sharded over the ranks, gradients summed."""
    ids, rows, targets = (xp.asarray(a) for a in (batch.ids, batch.rows, batch.targets))
    if runner is not None:
        return runner.run(ids, rows, targets, topk, batch.cu_seqlens, train=train, recompute=train,
                          kl_on_loss_rows=True)
    selector = LiveSelection(topk, cu_seqlens=batch.cu_seqlens)
    if not train:
        with no_grad():
            return model.forward(ids, rows, targets, selector, kl_on_loss_rows=True), selector.store
    out = model.forward(ids, rows, targets, selector, recompute=True, kl_on_loss_rows=True)
    backward(out.loss)
    return out, selector.store


def cross_entropy(out, model) -> float:
    """The answer loss of a forward: its total less the weighted indexer losses."""
    return out.total - model.cfg.kl_weight * sum(out.kls)


def evaluate(model, batch, topk, xp, runner=None) -> dict:
    """Cross-entropy, accuracy and per-layer needle recall in the sparse setting."""
    out, selections = run_model(model, batch, topk, xp, runner=runner)
    logits = to_host(out.logits)
    return {"loss": cross_entropy(out, model),
            "accuracy": float((logits.argmax(axis=1) == batch.targets).mean()),
            "recall": [needle_recall(selections.selection(b.name), batch) for b in model.blocks],
            "kl": out.kls}


def train(args, xp, task: NeedleTask, warm_task: NeedleTask, model: TinyDSA, runner=None,
          lead: bool = True) -> list[dict]:
    """The two stages; every rank runs this with the same batches, only ``lead`` prints."""
    opt = AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, max_grad_norm=1.0)
    rng = np.random.default_rng(args.seed + 1)
    eval_batch = task.batch(np.random.default_rng(args.seed + 2), args.eval_sequences)
    history = [{"step": 0, "stage": "init", **evaluate(model, eval_batch, args.topk, xp, runner)}]
    bar = Progress(args.steps, args.eval_every, quiet=not lead)
    bar.message(_eval_line(history[-1]))
    for step in range(1, args.steps + 1):
        dense = step <= args.warmup_steps
        stage_task = warm_task if dense else task
        batch = stage_task.batch(rng, max(1, args.tokens // stage_task.length))
        out, _ = run_model(model, batch, stage_task.length if dense else args.topk, xp, train=True, runner=runner)
        opt.lr = args.lr * 0.5 * (1 + np.cos(np.pi * step / args.steps))  # cosine decay
        opt.step()
        train_loss = cross_entropy(out, model)
        bar.update(step, f"{'dense' if dense else 'sparse'} L={stage_task.length} loss {train_loss:.3f}")
        if step % args.eval_every == 0 or step == args.steps:
            history.append({"step": step, "stage": "dense" if dense else "sparse", "train_loss": train_loss,
                            **evaluate(model, eval_batch, args.topk, xp, runner)})
            bar.message(_eval_line(history[-1]))
    return history


def _eval_line(h: dict) -> str:
    recall = " ".join(f"{r:.2f}" for r in h["recall"])
    return (f"step {h['step']:4d} ({h['stage']:6s}) eval: loss {h['loss']:.3f}  accuracy {h['accuracy']:.2f}  "
            f"needle recall per layer {recall}")


def write_log(path: Path, args, model: TinyDSA, xp, runner=None, lead: bool = True) -> None:
    """A rollout of the model: every layer's selection for ``--log-samples`` samples
    of ``--log-sequences`` packed sequences of ``--log-length`` tokens, top-``--log-topk``
    (every rank runs it; ``lead`` writes and prints)."""
    from hyscale_core.io import SelectionLog

    task = NeedleTask(length=args.log_length, fillers=256)
    rng = np.random.default_rng(args.seed + 3)
    with SelectionLog(path, "a" if args.log_append else "w") if lead else contextlib.nullcontext() as log:
        for sample in sample_names(args):
            batch = task.batch(rng, args.log_sequences)
            _, selections = run_model(model, batch, args.log_topk, xp, runner=runner)
            if not lead:
                continue
            for block in model.blocks:
                log.append(sample, block.name, selections.selection(block.name), cu_seqlens=batch.cu_seqlens)
            recall = " ".join(f"{needle_recall(selections.selection(b.name), batch):.2f}" for b in model.blocks)
            print(f"  {sample}: needle recall per layer {recall}", flush=True)
    if not lead:
        return
    n = args.log_sequences * task.length
    print(f"wrote {path}: {args.log_samples} samples x {len(model.blocks)} layers, selections int32 [{n}, "
          f"{args.log_topk}] ({args.log_sequences} packed sequences of {task.length})")


def plot(history: list[dict], args, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install \"hyscale-core[plot]\")")
        return
    steps = [h["step"] for h in history]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    left.plot(steps, [h["loss"] for h in history], "o-", label=f"eval (L={args.length}, top-{args.topk})")
    trained = [h for h in history if "train_loss" in h]
    left.plot([h["step"] for h in trained], [h["train_loss"] for h in trained], ".--",
              label=f"train batch (L={args.warmup_length} dense, then L={args.length})")
    left.set(xlabel="step", ylabel="cross-entropy", title="loss")
    for layer in range(len(history[0]["recall"])):
        right.plot(steps, [h["recall"][layer] for h in history], "o-", label=f"needle recall, layer {layer}")
    right.plot(steps, [h["accuracy"] for h in history], "s:", label="answer accuracy")
    right.axhline(args.topk / args.length, color="grey", lw=0.8, ls=":", label="random selection")
    right.set(xlabel="step", ylim=(0, 1.02), title=f"indexer recall of the needle (top-{args.topk} of {args.length})")
    for ax in (left, right):
        if 0 < args.warmup_steps < args.steps:
            ax.axvline(args.warmup_steps, color="grey", lw=0.8)
            ax.text(args.warmup_steps, 0.5, " dense | sparse ", transform=ax.get_xaxis_transform(), ha="center",
                    fontsize=7, color="grey", backgroundcolor="white")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(argv=None) -> int:
    args = parse(argv)
    world = launched_world()  # MPI.COMM_WORLD under `mpiexec -n P` with P > 1, else None (one process)
    refuse_path_problems(args, world)
    if world is None:
        return run(args)
    with abort_on_error(world):  # an exception on one rank ends the whole job
        return run(args, world)


def run(args, world=None) -> int:
    """Build, train, save; with ``world`` every batch is sharded over its ranks."""
    lead = world is None or world.Get_rank() == 0
    xp = array_module(args.device)
    if world is not None and xp is not np:
        use_local_gpu(world)  # one GPU per rank where there are several
    task = NeedleTask(length=args.length, fillers=256)
    warm_task = NeedleTask(length=args.warmup_length, fillers=256)
    cfg = DSAConfig(vocab=task.vocab, d_model=64, n_layers=args.layers, heads=4, d_v=32, rope_dim=16, d_ff=128,
                    index_heads=4, index_dim=16, topk=args.topk)
    model = TinyDSA(cfg, seed=args.seed, xp=xp)
    if args.load:
        with np.load(args.load) as state:
            model.load_state_dict(dict(state))
    runner = ShardedRunner(model, world) if world is not None else None
    where = "GPU (CuPy)" if xp is not np else "CPU (NumPy + Numba)"
    if runner is not None:
        where += f", every sequence sharded over {world.Get_size()} MPI ranks ({runner.transport.name} transport)"
    if lead:
        print(f"hyscale-core {hs.__version__} on {where}: {args.layers} DSA layers, "
              f"{sum(p.data.size for p in model.parameters())} parameters; {args.warmup_steps} dense warm-up steps "
              f"(L={args.warmup_length}), {args.steps - args.warmup_steps} sparse steps (L={args.length}, "
              f"top-{args.topk}); {args.tokens} tokens per step", flush=True)
    history = train(args, xp, task, warm_task, model, runner, lead)
    if lead:
        save(args, cfg, task, model, history)
    if args.log:
        write_log(args.log, args, model, xp, runner, lead)
    if runner is not None:
        runner.close()
    return 0


def save(args, cfg: DSAConfig, task: NeedleTask, model: TinyDSA, history: list[dict]) -> None:
    """History, parameters, config and the plot under ``--out``."""
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "history.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                       "history": history}, indent=1) + "\n")
    np.savez(args.out / "params.npz", **model.state_dict())
    (args.out / "config.json").write_text(json.dumps({"model": dataclasses.asdict(cfg),
                                                      "task": dataclasses.asdict(task)}, indent=1) + "\n")
    first, last = history[0], history[-1]
    print(f"eval loss {first['loss']:.3f} -> {last['loss']:.3f}; needle recall "
          f"{max(first['recall']):.2f} -> {max(last['recall']):.2f} (best layer); wrote {args.out}/history.json, "
          f"params.npz, config.json")
    if args.steps:
        plot(history, args, args.out / "curves.png")


if __name__ == "__main__":
    sys.exit(main())
