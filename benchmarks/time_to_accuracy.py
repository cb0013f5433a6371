"""Time to accuracy over slow links: every way to cut gradient traffic,
judged by how soon training reaches a target loss, side by side.

A small character-level transformer language model (3 layers, width 128,
0.6M parameters) learns a synthetic language made on the fly (a few hundred
made-up words chained by a sparse Markov chain, so there is something to
learn and a floor well below the unigram loss). Each rank samples its own
batches; every config trains from the same initial weights on the same
per-rank batch stream, for the same number of steps, with AdamW and the
same learning-rate schedule (a 20-step warmup, then a cosine decay to a
tenth; ``--schedule constant`` for a fixed rate).

Configs (``--configs``; every one by default):

    ddp                 DDP's own all-reduce (Gloo, float32): no hook
    torch-bf16          torch's bf16_compress_hook
    torch-powersgd-1/4  torch's powerSGD_hook, rank 1 / 4 (one bucket: with several it
                        hangs on Gloo; see docs/low_communication.md)
    int8, int4, topk    pycomm's int8_hook, int4_hook, topk_hook (1 %), error feedback;
                        int8-b64, int4-b32, ...: another block size (one scale per block);
                        -noef (e.g. int4-b64-noef): without error feedback
    bf16                pycomm's bf16_hook
    stale1-int8         pycomm's stale_hook: staleness 1, int8 on the wire (stale<S>[-bf16|-int8|-int4]:
                        any staleness and wire; none: float32)
    powersgd-1/4        pycomm's powersgd_hook, rank 1 / 4 (DDP's buckets)
    powersgd-1/4-int8   the same with int8 factors
    diloco-16/64        pycomm.DiLoCo, H = 16 / 64, plain pseudo-gradients
    streaming-diloco    pycomm.DiLoCo, H = 16, 4 fragments, overlap, int4 wire
                        (= diloco-16-f4-int4-overlap)

A gradient config with ``-1b`` (e.g. ``int4-1b``) puts the whole model in one
DDP bucket: one call per step instead of DDP's two here, no overlap with the
backward pass (torch's PowerSGD hook always runs so); ``-bc<MB>`` (e.g.
``int4-bc1.5``) caps every bucket, the first too, at that many MB.

Any DiLoCo variant by name: ``diloco-<H>`` and, in any order, ``-f<F>``
(fragments), ``-int8`` / ``-int4`` / ``-bf16`` (the wire), ``-overlap`` or
``-overlap<tau>`` (syncs travel behind 1 or tau inner steps), ``-a<alpha>``
(the ranks mix alpha of their parameters with the new global ones),
``-m<momentum>`` and ``-lr<outer lr>`` (the outer step; 0.9 and 0.7 by
default, as in the paper), e.g. ``diloco-8-f4-int4-overlap2-a0.5-m0.5``.

Reported per config: time to the target loss (wall clock of training from
the first step, the periodic evaluations off the clock),
the step at which it was reached, step time (training wall clock / steps, so
DiLoCo's sync steps count), bytes per step (what the rank's network interface
sent, every byte on the wire), and the final held-out loss. The loss is each
rank's own model on a fixed held-out set, averaged over ranks: 64 sequences
during training (``--held-out``), 1024 for the final loss
(``--final-held-out``), whose noise would otherwise be larger than the 1 %
the comparison asks about.

Run everything (3 fresh launches x 1 Gbit/s and 100 Mbit/s on 4 simulated
hosts; needs root, see benchmarks/multihost/testbed.py), then the table and a
plot::

    python benchmarks/time_to_accuracy.py --launches 3 --rates 1gbit,100mbit --out build/tta

The table and plot again from saved runs, for another target::

    python benchmarks/time_to_accuracy.py --summarize build/tta --target 1.3

One launch by hand (what the driver runs on every host)::

    python benchmarks/multihost/testbed.py --hosts 4 --rate 1gbit -- \\
        benchmarks/time_to_accuracy.py --worker --json /tmp/tta.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from typing import Dict, List, Optional

import torch

import tta_report
from tta_report import first_under, retarget

HERE = os.path.dirname(os.path.abspath(__file__))
ALL_CONFIGS = ("ddp,torch-bf16,torch-powersgd-1,torch-powersgd-4,int8,topk,stale1-int8,powersgd-1,powersgd-4,"
               "powersgd-1-int8,powersgd-4-int8,diloco-16,diloco-64,streaming-diloco")
ALPHABET = "abcdefghijklmnopqrstuvwxyz ."
BLOCKS = ("32", "64", "128", "256", "512")  # int8-b<block> / int4-b<block>: the codec's block size


# ------------------------------------------------------------------ the task

def language(seed: int = 0, words: int = 300):
    """The synthetic language: ``words`` made-up words of 2-7 letters (two may
    share a spelling), and each word's 4 possible successors (word indices)."""
    g = random.Random(seed)
    vocab = ["".join(g.choice(ALPHABET[:26]) for _ in range(g.randint(2, 7))) for _ in range(words)]
    succ = [g.sample(range(words), 4) for _ in range(words)]
    return vocab, succ, g


def make_corpus(chars: int, seed: int = 0, words: int = 300) -> torch.Tensor:
    """The language as character ids: sentences of 4-12 words, each word
    followed by one of its 4 successors (weights .55/.25/.15/.05)."""
    vocab, succ, g = language(seed, words)
    out: List[str] = []
    n = 0
    while n < chars:
        w = g.randrange(words)
        sentence = []
        for _ in range(g.randint(4, 12)):
            sentence.append(vocab[w])
            w = g.choices(succ[w], (0.55, 0.25, 0.15, 0.05))[0]
        s = " ".join(sentence) + ". "
        out.append(s)
        n += len(s)
    index = {c: i for i, c in enumerate(ALPHABET)}
    return torch.tensor([index[c] for c in "".join(out)[:chars]], dtype=torch.long)


class CharLM(torch.nn.Module):
    """A decoder-only transformer (pre-norm, causal) over characters."""

    def __init__(self, width: int, layers: int, context: int, vocab: int = len(ALPHABET)) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        # Positions start at unit scale, like the token embeddings: from a
        # small start (0.02) this model sits on a loss plateau for hundreds of
        # steps before attention learns to use them, which would make time to
        # target a measure of when that happens to break.
        self.position = torch.nn.Parameter(torch.randn(context, width))
        layer = torch.nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=4 * width, dropout=0.0,
                                                 batch_first=True, norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        h = self.embed(x) + self.position[:t]
        h = self.blocks(h, mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(h))


def batch(text: torch.Tensor, n: int, context: int, gen: torch.Generator):
    starts = torch.randint(0, len(text) - context - 1, (n,), generator=gen)
    idx = starts[:, None] + torch.arange(context + 1)
    seq = text[idx]
    return seq[:, :-1], seq[:, 1:]


def held_out_split(args):
    """The training text, and held-out sequences cut from the corpus' end
    (the same language, sentences no batch is drawn from): the first
    ``--held-out`` of them for the evaluations during training, all
    ``--final-held-out`` for the final loss."""
    held = max(args.held_out, args.final_held_out)
    n = held * (args.context + 1)
    text = make_corpus(args.corpus_chars + n, seed=args.seed)
    return text[:-n], text[-n:].view(held, args.context + 1)


def lr_at(step: int, args) -> float:
    """The (inner) learning rate of ``step`` (1-based): constant, or a linear
    warmup and a cosine decay to a tenth, as language models are trained. The
    decay is what makes the final loss a fair comparison: at a constant rate
    the last iterate wanders by a few per cent from one evaluation to the next."""
    if args.schedule == "constant":
        return args.lr
    if step <= args.warmup:
        return args.lr * step / args.warmup
    done = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * done)))


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def tx_bytes() -> Optional[int]:
    """Bytes this network namespace's link has sent (the testbed's eth0)."""
    dev = os.environ.get("GLOO_SOCKET_IFNAME")
    if not dev:
        return None
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == dev:
                return int(rest.split()[8])
    return None


# ------------------------------------------------------------------ the configs

def diloco_options(name: str) -> Dict:
    """pycomm.DiLoCo's arguments for a config name (see the module's docstring)."""
    import pycomm

    parts = ("diloco-16-f4-int4-overlap" if name == "streaming-diloco" else name).split("-")
    wires = {"int8": pycomm.Int8(), "int4": pycomm.Int4(), "bf16": torch.bfloat16}
    try:
        out: Dict = dict(sync_every=int(parts[1]))
        for p in parts[2:]:
            if p in wires:
                out["wire"] = wires[p]
            elif p.startswith("overlap"):
                out["overlap"] = int(p[7:]) if p[7:] else True
            elif p.startswith("a"):
                out["alpha"] = float(p[1:])
            elif p.startswith("lr"):
                out["outer_lr"] = float(p[2:])
            elif p[0] in "fm":
                out["fragments" if p[0] == "f" else "outer_momentum"] = (int if p[0] == "f" else float)(p[1:])
            else:
                raise ValueError(p)
    except (IndexError, ValueError):
        raise SystemExit(f"unknown DiLoCo config {name!r}: diloco-<H>[-f<F>][-int8|-int4|-bf16][-overlap[<tau>]]"
                         "[-a<alpha>][-m<momentum>][-lr<outer lr>]") from None
    return out


def build(name: str, model: torch.nn.Module, args, comm):
    """(the module to call, the optimizer to step, the hook state or None)."""
    import pycomm
    from pycomm import hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    from ddp_hooks import torch_bf16_hook

    def adamw(params):
        return torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)

    if name.startswith("diloco-") or name == "streaming-diloco":
        opt = pycomm.DiLoCo(model.parameters(), adamw(model.parameters()), communicator=comm,
                            **diloco_options(name))
        return model, opt, None
    full_name = name
    bucket_mb = None
    head, _, cap = name.rpartition("-bc")
    if head and cap.replace(".", "", 1).isdigit():
        name, bucket_mb = head, float(cap)  # every bucket (the first too) up to this many MB
    if name.endswith("-1b"):
        name = name[:-3]
    one_bucket = full_name.endswith("-1b") or name.startswith("torch-powersgd")
    if one_bucket:
        bucket_mb = 1 << 16
    ddp = DDP(model, gradient_as_bucket_view=True, **(dict(bucket_cap_mb=bucket_mb) if bucket_mb else {}))
    feedback = not name.endswith("-noef")
    quantizer, _, block = name.removesuffix("-noef").partition("-b")  # int8 / int4, and a block size if given
    state = None
    if name == "torch-bf16":
        ddp.register_comm_hook(None, torch_bf16_hook)
    elif name.startswith("torch-powersgd-"):
        ddp.register_comm_hook(torch_psgd.PowerSGDState(
            process_group=None, matrix_approximation_rank=int(name.split("-")[2]),
            start_powerSGD_iter=args.start_iter), torch_psgd.powerSGD_hook)
    elif name.startswith("powersgd-"):
        state = hooks.PowerSGDState(rank=int(name.split("-")[1]), start_iter=args.start_iter, communicator=comm,
                                    wire=pycomm.Int8() if name.endswith("-int8") else None)
        ddp.register_comm_hook(state, hooks.powersgd_hook)
    elif quantizer in ("int8", "int4") and block in ("", *BLOCKS):
        kind = pycomm.Int8 if quantizer == "int8" else pycomm.Int4
        state = hooks.CompressionState(codec=kind(block=int(block)) if block else kind(),
                                       start_iter=args.start_iter, error_feedback=feedback, communicator=comm)
        ddp.register_comm_hook(state, hooks.int8_hook if quantizer == "int8" else hooks.int4_hook)
    elif name == "bf16":
        ddp.register_comm_hook(hooks.HookState(communicator=comm), hooks.bf16_hook)
    elif name == "topk":
        state = hooks.CompressionState(codec=pycomm.TopK(0.01), start_iter=args.start_iter, communicator=comm)
        ddp.register_comm_hook(state, hooks.topk_hook)
    elif name.startswith("stale") and name[5:].partition("-")[0].isdigit():
        staleness, _, wire = name[5:].partition("-")
        wires = {"": None, "bf16": torch.bfloat16, "int8": pycomm.Int8(), "int4": pycomm.Int4()}
        if wire not in wires:
            raise SystemExit(f"unknown config {full_name!r}: stale<S>[-bf16|-int8|-int4]")
        state = hooks.StaleState(staleness=int(staleness), wire=wires[wire], communicator=comm)
        ddp.register_comm_hook(state, hooks.stale_hook)
    elif name != "ddp":
        raise SystemExit(f"unknown config {full_name!r}; known: {ALL_CONFIGS}")
    return ddp, adamw(model.parameters()), state


def train(name: str, args, text, held_x, held_y, comm) -> Dict:
    import pycomm
    import torch.distributed as dist
    from pycomm import hooks

    rank = dist.get_rank()
    torch.manual_seed(args.seed)
    model = CharLM(args.width, args.layers, args.context)
    net, opt, state = build(name, model, args, comm)
    gen = torch.Generator().manual_seed(1000 + rank)
    curve, step_times = [], []
    dist.barrier()
    # The clock: training only. An evaluation (64 sequences, the compute of
    # ~5 training steps here) is off it unless --eval-on-clock: on it, it
    # adds the same seconds to every config and pulls every ratio towards 1.
    # Off it, what is in flight across it (a stale hook's average, an
    # overlapped DiLoCo fragment) travels for free: at most one step's
    # communication per --eval-every steps.
    clock, mark = 0.0, time.perf_counter()
    tx0 = tx_bytes()
    for step in range(1, args.steps + 1):
        x, y = batch(text, args.batch, args.context, gen)
        t = time.perf_counter()
        for g in opt.param_groups:  # DiLoCo's are its inner optimizer's
            g["lr"] = lr_at(step, args)
        opt.zero_grad()
        loss_of(net, x, y).backward()
        opt.step()
        if step == args.steps:  # what is still in flight belongs to training
            if isinstance(opt, pycomm.DiLoCo):
                opt.sync()
            elif isinstance(state, hooks.StaleState):
                for _ in state.flush():
                    opt.step()
        step_times.append(time.perf_counter() - t)
        if step % args.eval_every == 0 or step == args.steps:
            now = time.perf_counter()
            clock, mark = clock + (now - mark), now
            model.eval()
            with torch.no_grad():
                held = loss_of(model, held_x[:args.held_out], held_y[:args.held_out]).item()
                final = loss_of(model, held_x, held_y).item() if step == args.steps else 0.0
            model.train()
            v = torch.tensor([held, clock, final], dtype=torch.float64) / dist.get_world_size()
            dist.all_reduce(v)
            curve.append((step, round(v[1].item(), 3), round(v[0].item(), 4)))
            final_loss = round(v[2].item(), 4)
            if not args.eval_on_clock:
                mark = time.perf_counter()
    sent = tx_bytes()
    reached = first_under(curve, args.target)
    v = torch.tensor([sum(step_times), clock, (sent - tx0) if sent is not None else -1], dtype=torch.float64)
    dist.all_reduce(v, op=dist.ReduceOp.MAX)
    row = dict(config=name, step_ms=v[0].item() / args.steps * 1e3, train_s=v[1].item(),
               bytes_per_step=v[2].item() / args.steps if v[2].item() >= 0 else None,
               final_loss=final_loss, steps_to_target=reached[0] if reached else None,
               time_to_target_s=reached[1] if reached else None, curve=curve)
    del net, opt, state
    return row


def worker(args) -> int:
    import pycomm
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    comm = pycomm.get_default()
    rank, world = dist.get_rank(), dist.get_world_size()
    text, held = held_out_split(args)
    held_x, held_y = held[:, :-1], held[:, 1:]
    names = args.configs.split(",")
    shift = args.rotate % len(names)  # a launch's turn in the rotation: drift hits every config alike
    names = names[shift:] + names[:shift]
    params = sum(p.numel() for p in CharLM(args.width, args.layers, args.context).parameters())
    if rank == 0:
        print(f"# time to accuracy: char LM {params / 1e6:.2f}M parameters, {world} ranks x batch {args.batch} x "
              f"context {args.context}, {args.steps} steps, AdamW lr {args.lr}, target loss {args.target}, "
              f"transport {comm.transport}", flush=True)
    rows = []
    for name in names:
        row = train(name, args, text, held_x, held_y, comm)
        rows.append(row)
        if rank == 0:
            ttt = f"{row['time_to_target_s']:7.1f} s (step {row['steps_to_target']})" \
                if row["time_to_target_s"] is not None else "  not reached   "
            mb = f"{row['bytes_per_step'] / 1e6:7.3f} MB/step" if row["bytes_per_step"] is not None else ""
            print(f"{name:>18} | target {ttt} | step {row['step_ms']:7.1f} ms | {mb} | "
                  f"final loss {row['final_loss']:.4f}", flush=True)
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "params": params, "world": world, "rows": rows}, f)
    pycomm.destroy()
    dist.destroy_process_group()
    return 0


# ------------------------------------------------------------------ the driver

def summarize(runs: Dict[str, List[Dict]], out: str) -> str:
    """The table and plot of saved runs (:func:`tta_report.summarize`), configs in ALL_CONFIGS' order."""
    return tta_report.summarize(runs, out, ALL_CONFIGS.split(","))


def driver(args, forward: List[str]) -> int:
    sys.path.insert(0, os.path.join(HERE, "multihost"))
    from testbed import Testbed, TestbedError, ensure_tools

    os.makedirs(args.out, exist_ok=True)
    runs: Dict[str, List[Dict]] = {}
    try:
        ensure_tools()
        for launch in range(args.launches):
            for rate in args.rates.split(","):
                path = os.path.join(args.out, f"{rate}-launch{launch + 1}.json")
                print(f"# launch {launch + 1}, {rate}", flush=True)
                with Testbed(4, rate=rate, delay=args.delay) as tb:
                    code = tb.launch(1, [os.path.abspath(__file__), "--worker", "--json", path,
                                         "--rotate", str(launch), *forward], timeout=args.timeout)
                if code != 0:
                    print(f"launch {launch + 1} at {rate} failed (exit {code})", file=sys.stderr)
                    return code
                with open(path) as f:
                    runs.setdefault(rate, []).append(json.load(f))
    except TestbedError as e:
        print(f"testbed: {e}", file=sys.stderr)
        return 2
    return tta_report.write_summary(summarize(runs, args.out), args.out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="store_true", help="run as one rank (under torchrun)")
    p.add_argument("--launches", type=int, default=3)
    p.add_argument("--rates", default="1gbit,100mbit", help="link rates, one testbed per rate and launch")
    p.add_argument("--delay", default="0.1ms")
    p.add_argument("--out", default="build/time_to_accuracy")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per launch")
    p.add_argument("--json", default=None)
    p.add_argument("--rotate", type=int, default=0)
    p.add_argument("--summarize", metavar="DIR", default=None,
                   help="only redraw the table and plot of the runs saved in DIR (with --target: for that target)")
    forwarded = p.add_argument_group("training (passed to every rank)")
    forwarded.add_argument("--configs", default=ALL_CONFIGS)
    forwarded.add_argument("--steps", type=int, default=400)
    forwarded.add_argument("--eval-every", type=int, default=10)
    forwarded.add_argument("--eval-on-clock", type=int, default=0,
                           help="1: count the evaluations in the time (how RESULTS' first tables were measured)")
    forwarded.add_argument("--target", type=float, default=None, help="held-out loss, nats per character (1.2)")
    forwarded.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    forwarded.add_argument("--context", type=int, default=32)
    forwarded.add_argument("--width", type=int, default=128)
    forwarded.add_argument("--layers", type=int, default=3)
    forwarded.add_argument("--lr", type=float, default=3e-3)
    forwarded.add_argument("--schedule", choices=("cosine", "constant"), default="cosine",
                           help="inner learning rate: warmup + cosine decay to lr/10, or constant")
    forwarded.add_argument("--warmup", type=int, default=20, help="warmup steps of the cosine schedule")
    forwarded.add_argument("--start-iter", type=int, default=10, help="plain iterations of the gradient hooks")
    forwarded.add_argument("--corpus-chars", type=int, default=500_000)
    forwarded.add_argument("--held-out", type=int, default=64, help="held-out sequences of each evaluation")
    forwarded.add_argument("--final-held-out", type=int, default=1024,
                           help="held-out sequences of the final loss (the last evaluation)")
    forwarded.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    target_given = args.target is not None
    if not target_given:
        args.target = 1.2
    if args.worker:
        return worker(args)
    if args.summarize:
        runs: Dict[str, List[Dict]] = {}
        for name in sorted(os.listdir(args.summarize)):
            if name.endswith(".json") and "-launch" in name:
                with open(os.path.join(args.summarize, name)) as f:
                    run = json.load(f)
                if target_given:
                    retarget(run, args.target)
                runs.setdefault(name.split("-launch")[0], []).append(run)
        return tta_report.write_summary(summarize(runs, args.summarize), args.summarize)
    forward = []
    for a in forwarded._group_actions:
        forward += [a.option_strings[0], str(getattr(args, a.dest))]
    return driver(args, forward)


if __name__ == "__main__":
    sys.exit(main())
