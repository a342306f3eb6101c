"""Launch the trainer: under torchrun, or self-spawned gloo CPU ranks.

    torchrun --nproc-per-node 4 -m deltacp.train --config configs/tiny_cp4.yaml      # GPUs: NCCL; CPU: gloo
    python -m deltacp.train --config configs/tiny_cp4.yaml --spawn 4                # no launcher, gloo ranks
    python -m deltacp.train --config configs/tiny_cp4.yaml --set train.steps=20 --set train.accelerator.cp=2 --spawn 2
    python -m deltacp.train --config configs/tiny_cp4.yaml --set train.data.batch_size=2 --spawn 8   # dp 2 x cp 4

A bad config is one line naming the key (exit 2), found before any rank starts, as are a model the CP layout
cannot split (e.g. full_attention_cp=ulysses with num_attention_heads not divisible by cp), unreadable or
untrainable data, a tokenizer directory without a tokenizer, an unwritable train.checkpoint.dir and a checkpoint
there that cannot be resumed (deltacp.train.preflight; under torchrun every rank checks before its process
group). A failed rank prints one line, `deltacp.train: rank R failed: ...`; a dead peer or a collective that
outlives train.distributed.timeout_s says so (exit 1).
Set DELTACP_TRACEBACK=1 for full tracebacks.

With --spawn, SIGINT (Ctrl-C) or SIGTERM to the launcher stops the job: the launcher sends SIGTERM to every
rank, waits for them (SIGKILL after 10 s), prints one line and exits 128 + the signal number (130, 143). The
ranks ignore SIGINT themselves and die with the launcher even if it is SIGKILLed (deltacp.distributed.launch).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys
import traceback

# Only the config is imported up front (it loads torch and torch.distributed, through the CP plan's rules): a bad key
# or value is reported before transformers' models, the checkpoint code and the process group load (seconds on a
# busy machine).
from deltacp.train.config import ConfigError, TrainConfig, load_config

_COMM_FAILURE = re.compile(r"timed out|timeout|connection (closed|reset|refused)|closed by peer|broken pipe|"
                           r"watchdog|socket", re.IGNORECASE)


def describe_failure(exc: BaseException, rank: int, cfg: TrainConfig | None) -> str:
    import torch.distributed as dist

    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    first = lines[0] if lines else type(exc).__name__
    if isinstance(exc, ConfigError):
        return f"deltacp.train: config error: {first}"
    comm = isinstance(exc, getattr(dist, "DistError", ())) or bool(_COMM_FAILURE.search(first))
    if comm:
        timeout = cfg.distributed.timeout_s if cfg is not None else "?"
        return (f"deltacp.train: rank {rank} failed in a collective (a peer died, or no progress within "
                f"train.distributed.timeout_s={timeout} s): {type(exc).__name__}: {first[:300]}")
    return f"deltacp.train: rank {rank} failed: {type(exc).__name__}: {first[:500]}"


def _setup_logging(rank: int) -> None:
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(message)s", force=True)


def run_rank(cfg: TrainConfig) -> None:
    """One rank of the job; on failure prints one line and exits the process (no hang in teardown)."""
    from deltacp.train.checkpoint import CheckpointError
    from deltacp.train.trainer import Trainer

    rank = int(os.environ.get("RANK", "0"))
    _setup_logging(rank)
    try:
        Trainer(cfg).fit()
    except KeyboardInterrupt:  # Ctrl-C under torchrun or a plain one-rank run: one line from rank 0
        if rank == 0:
            print("deltacp.train: stopped by SIGINT", file=sys.stderr, flush=True)
        os._exit(128 + signal.SIGINT)
    except BaseException as exc:  # noqa: BLE001  (one line per failed rank, then a hard exit)
        if os.environ.get("DELTACP_TRACEBACK"):
            traceback.print_exc()
        if not (isinstance(exc, (ConfigError, CheckpointError)) and rank != 0):  # the same on every rank
            print(describe_failure(exc, rank, cfg), file=sys.stderr, flush=True)
        os._exit(2 if isinstance(exc, ConfigError) else 1)


def _spawned(rank: int, world: int, cfg: TrainConfig) -> None:
    run_rank(cfg)


class Stopped(BaseException):
    """The launcher received SIGINT or SIGTERM (raised by its signal handler)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _raise_stopped(signum, frame) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):  # a second signal must not interrupt stopping the ranks
        signal.signal(sig, signal.SIG_IGN)
    raise Stopped(signum)


def spawn(fn, world_size: int, cfg: TrainConfig, *args) -> None:
    """Run fn(rank, world, cfg, *args) on `world_size` gloo ranks; exit 1 with one line if a rank failed.

    SIGINT/SIGTERM: the ranks are stopped (run_distributed's clean-up: SIGTERM, SIGKILL after a grace
    period), one line is printed and the launcher exits 128 + signum."""
    from deltacp.distributed.launch import run_distributed

    previous = {sig: signal.signal(sig, _raise_stopped) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        run_distributed(fn, world_size, cfg, *args, timeout_s=10 ** 7,
                        collective_timeout_s=cfg.distributed.timeout_s)
    except Stopped as stop:
        name = signal.Signals(stop.signum).name
        print(f"deltacp.train: stopped by {name}: terminated the {world_size} ranks (a checkpoint being saved is "
              f"left as .tmp, never loaded)", file=sys.stderr, flush=True)
        sys.exit(128 + stop.signum)
    except Exception as exc:  # the failed rank has printed its line already
        print(f"deltacp.train: the {world_size}-rank run failed ({type(exc).__name__}: "
              f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''})", file=sys.stderr, flush=True)
        sys.exit(1)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def parse_config(parser: argparse.ArgumentParser, args: argparse.Namespace, launch: bool = True) -> TrainConfig:
    """The config of args.config and args.set. `launch` (the trainer): also every check that needs no rank, at the
    world size the launch gives (--spawn N, torchrun's WORLD_SIZE, else 1) and `preflight`'s (model vs layout,
    data, tokenizer, checkpoint directory): one line and exit 2 before any rank starts (under torchrun, on every
    rank before its process group)."""
    try:
        cfg = load_config(args.config, args.set)
    except CONFIG_ERRORS as exc:
        _exit_with("config error", exc)
    from deltacp.train.checkpoint import CheckpointError
    from deltacp.train.preflight import preflight

    try:
        if launch:
            if args.spawn is not None:
                if cfg.distributed.backend == "nccl":
                    raise ConfigError("train.distributed.backend='nccl' cannot be used with --spawn, which runs gloo "
                                      "ranks: set train.distributed.backend to auto or gloo, or launch with torchrun")
                cfg.validate_world(args.spawn)
                if cfg.device == "auto":
                    cfg = cfg.replace(device="cpu")  # --spawn means gloo CPU ranks unless train.device says cuda
            else:
                cfg.validate_world(int(os.environ.get("WORLD_SIZE", "1")))
            preflight(cfg, spawn=args.spawn is not None)
    except CheckpointError as exc:
        _exit_with("checkpoint error", exc)
    except CONFIG_ERRORS as exc:
        _exit_with("config error", exc)
    return cfg


CONFIG_ERRORS = (ConfigError, ValueError, NotImplementedError, OSError)  # a bad config, reported in one line


def _exit_with(kind: str, exc: BaseException):
    """One line on stderr and exit status 2, before any rank starts."""
    print(f"deltacp.train: {kind}: {exc}", file=sys.stderr)
    sys.exit(2)


def add_common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="trainer YAML (top-level key: train)")
    parser.add_argument("--set", action="append", default=[], metavar="train.KEY=VALUE",
                        help="override one config value (YAML syntax), repeatable")
    parser.add_argument("--spawn", type=int, default=None, metavar="N",
                        help="spawn N gloo ranks here instead of running under torchrun (CPU unless "
                             "train.device is cuda)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m deltacp.train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    args = parser.parse_args(argv)
    cfg = parse_config(parser, args)
    if args.spawn is not None:
        spawn(_spawned, args.spawn, cfg)
        return
    from deltacp.distributed.launch import free_port

    if "RANK" not in os.environ:  # plain `python -m deltacp.train` = one rank
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT") or str(free_port()))
    run_rank(cfg)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
