"""The parameter-server run (``parallel.sync_mode = "async"``), what :func:`meshtrain.train.entry.train` runs
instead of the synchronous loop: servers and workers of :mod:`meshtrain.parallel.async_ps` around the
same set-up, data, optimizer, metrics and checkpoints as :class:`meshtrain.train.loop.Trainer`
(:mod:`meshtrain.train.setup`).

- Every rank builds the whole model from ``train.seed``; server ``s`` keeps the AdamW state of its
  shard (:func:`meshtrain.parallel.async_ps.shard_parameters`), workers compute on full copies.
- Worker ``w`` (of W) reads the ``w``-th share of each step of the data stream, ``micro_batch_size *
  gradient_accumulation_steps`` samples per gradient, and clips its own gradient's norm.
- ``train.steps`` counts gradients received by the servers; the learning rate of the update made by
  gradient ``k`` is the synchronous schedule's at step ``k`` (scaled, with ``optim.lr_scaling``, to one
  worker's batch). Workers compute under bf16 autocast where ``train.dtype`` resolves to bfloat16
  (:func:`meshtrain.runtime.device.compute_dtype`), as the synchronous trainer does.
- Server 0 logs every ``log_interval`` gradients (mean worker loss, mean staleness, gradients
  dropped so far), evaluates and checkpoints on the synchronous schedule; with several servers they
  first exchange their shards.
- A checkpoint holds the parameters, every server's AdamW state, the count and each worker's position
  in the data stream, so ``--resume`` continues the run (asynchrony makes the order of updates, and so
  the exact numbers, differ from run to run).

Messages are CPU tensors over gloo (a server receives from any worker, which gloo supports), so this
mode runs on the CPU.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshtrain.checkpoint import store as ckpt
from meshtrain.batch_math import tokens_per_step
from meshtrain.config.sections import Config
from meshtrain.errors import ConfigError
from meshtrain.data.sampler import ShardedSampler, eval_batches
from meshtrain.metrics import MetricsLog, peak_memory_bytes, write_summary
from meshtrain.models.hf import load_hf_weights
from meshtrain.models.resize import GrownRows
from meshtrain.optim.build import build_optimizer
from meshtrain.optim.schedule import lr_at, scaled_optim
from meshtrain.parallel.async_ps import ParameterServer, Worker, shard_parameters
from meshtrain.parallel.reduce import clip_grad_norm_, cross_entropy
from meshtrain.resolved import ResolvedRun, config_of, for_world
from meshtrain.runtime.distributed import collective_timeout, init_distributed
from meshtrain.train.setup import checkpoint_meta, run_summary, set_up


class AsyncRun:
    """One rank of a parameter-server run; :meth:`run` trains and returns rank 0's summary."""

    def __init__(self, run: ResolvedRun | Config) -> None:
        timeout = config_of(run).train.collective_timeout_s
        self.rank, world = init_distributed("gloo", timeout)
        self.resolved = for_world(run, world)
        self.cfg = cfg = self.resolved.config
        b, t = cfg.batch, cfg.train
        ps = cfg.parameter_server
        self.servers = list(range(ps.servers))
        self.workers = list(range(ps.servers, world))
        self.setup = set_up(cfg, torch.device("cpu"))
        self.corpus, self.model = self.setup.corpus, self.setup.model
        self.autocast = self.setup.autocast
        """The workers' forward (and server 0's evaluation) under bf16 autocast where ``train.dtype`` asks for
        it, as in the synchronous trainer; parameters, gradients and the servers' AdamW stay fp32."""
        params = list(self.model.parameters())
        owners = shard_parameters([q.numel() for q in params], len(self.servers))
        self.shards = {s: [params[i] for i in owners[s]] for s in self.servers}
        self.server_group = dist.new_group(self.servers, timeout=collective_timeout())  # every rank takes part in creating it
        self.out_dir = Path(t.out_dir)
        self.batch = self.resolved.global_batch_size  # one worker's: one gradient
        self.resume = ckpt.resume_checkpoint(cfg)
        if not self.resume and cfg.model.init_from:
            growth = self.setup.growth  # every rank holds the whole model
            grown = growth and GrownRows(growth.old, growth.new, cfg.train.seed)
            load_hf_weights(self.model, cfg.model.init_from, cfg.model, grown)
            if grown and self.rank == 0:
                print(growth.describe(cfg.model.init_from, cfg.train.seed, grown.sampled), file=sys.stderr, flush=True)
        meta = ckpt.read_meta(self.resume) if self.resume else {}
        self.start = int(meta.get("step", 0))
        state = meta.get("async", {})
        if self.rank in self.servers:
            names = {id(p): n for n, p in self.model.named_parameters()}
            self.optimizer, _ = build_optimizer([(names[id(p)], p) for p in self.shards[self.rank]], cfg, self.batch)
            if self.resume:
                ckpt.load(self.resume, self.model, self.optimizer, group=self.server_group)
            optim = scaled_optim(cfg.optim, self.batch)
            self.server = ParameterServer(self.shards[self.rank], self.optimizer, lambda k: lr_at(k, optim, t.steps),
                                          self.workers, cfg.parameter_server.max_staleness,
                                          cfg.parameter_server.stale_policy, t.steps, self.start,
                                          self._on_gradient)
            self.server.version = int(state.get("version", self.start))
        else:
            index = self.rank - len(self.servers)
            self.sampler = ShardedSampler(self.corpus.train, cfg.model.block_size, b.micro_batch_size,
                                          b.gradient_accumulation_steps, len(self.workers), index, t.seed)
            if self.resume:
                self.sampler.load_state_dict({**meta["sampler"], "samples_seen": state["samples_seen"][index]})
        self.samples_seen = list(state.get("samples_seen", [0] * len(self.workers)))
        self.log: MetricsLog | None = None
        self.window: list[tuple[float, float]] = []  # (loss, staleness) since the last record
        self.window_start = time.perf_counter()
        self.step_times: list[float] = []
        self.val_loss: float | None = None

    # --- workers ------------------------------------------------------------------------------------

    def _compute(self) -> tuple[float, int]:
        """Forward and backward of this worker's next batch; clip; return (mean loss, stream position)."""
        micro_batches = self.sampler.next_step()
        total = 0.0
        for x, y in micro_batches:
            with self.autocast:
                logits = self.model(x)  # (mbs, T, V)
            loss = cross_entropy(logits, y)
            (loss / len(micro_batches)).backward()
            total += float(loss.detach())
        clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip)
        return total / len(micro_batches), self.sampler.samples_seen

    # --- servers ------------------------------------------------------------------------------------

    def _on_gradient(self, header: torch.Tensor, applied: bool, staleness: int) -> None:
        """After every gradient a server received: server 0 records it; every server joins the evaluations
        and checkpoints due at this count."""
        k, t, c = self.server.stats.received, self.cfg.train, self.cfg.checkpoint
        worker = int(header[4])
        self.samples_seen[worker] = int(header[2])
        self.window.append((float(header[3]), float(staleness) if applied else float("nan")))
        last = k == t.steps
        if k % t.log_interval == 0 or last:
            self._record(k)
        evaluate = last or (t.eval_interval and k % t.eval_interval == 0)
        save = last or (c.interval and k % c.interval == 0)
        if evaluate or save:
            self._gather_shards()
        if evaluate and self.rank == 0:
            self.val_loss = self._evaluate()
            self.log.eval(k, self.val_loss)
        if save:
            self._save(k)

    def _record(self, k: int) -> None:
        now = time.perf_counter()
        dt = (now - self.window_start) / len(self.window)
        self.step_times.append(dt)
        stale = [s for _, s in self.window if s == s]  # applied ones (NaN marks a dropped gradient)
        record = {"step": k, "loss": statistics.fmean(loss for loss, _ in self.window), "lr": self.server.lr_of(k - 1),
                  "tokens_per_s": tokens_per_step(self.batch, self.cfg.model.block_size) / dt, "step_time_s": dt,
                  "staleness": statistics.fmean(stale) if stale else None, "dropped": self.server.stats.dropped,
                  "peak_memory_bytes": peak_memory_bytes("cpu")}  # server 0's, so far
        if self.log is not None:
            self.log.step(k, record)
        self.window, self.window_start = [], now

    @torch.no_grad()
    def _gather_shards(self) -> None:
        """Every server gets every shard's current values (a broadcast from each owner, server group)."""
        if len(self.servers) > 1:
            for server, params in self.shards.items():
                for q in params:
                    dist.broadcast(q.data, src=server, group=self.server_group)

    @torch.no_grad()
    def _evaluate(self) -> float:
        """Val loss over the set a synchronous run with dp = W evaluates (every worker's share)."""
        b, t = self.cfg.batch, self.cfg.train
        W = len(self.workers)
        batches = [xy for w in range(W) for xy in eval_batches(self.corpus.val, self.cfg.model.block_size,
                                                                 b.micro_batch_size, t.eval_steps, W, w, t.seed)]
        self.model.eval()
        with self.autocast:
            loss = statistics.fmean(float(cross_entropy(self.model(x), y)) for x, y in batches)
        self.model.train()
        return loss

    def _save(self, k: int) -> None:
        sampler = ShardedSampler(self.corpus.train, self.cfg.model.block_size, 1, 1, 1, 0, self.cfg.train.seed)
        meta = checkpoint_meta(self.cfg, self.setup, sampler.state_dict(), self._layout(), self.batch,
                               **{"async": {"version": self.server.version, "samples_seen": self.samples_seen}})
        ckpt.save(self.out_dir, k, self.model, self.optimizer, meta, keep=self.cfg.checkpoint.keep,
                  group=self.server_group)

    # --- both ---------------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """Serve or work until ``train.steps`` gradients were received; return the run's summary (rank 0's
        ``OUT/summary.json``: val loss, seconds per received gradient, peak memory over ranks, and the
        servers' counts of applied and dropped gradients and their staleness)."""
        t = self.cfg.train
        if self.start >= t.steps:
            raise ConfigError(f"train.steps = {t.steps} but the checkpoint is already at step {self.start}")
        self.log = (MetricsLog(self.out_dir, True, self.start, t.steps, tensorboard=t.tensorboard)
                    if self.rank == 0 else None)
        try:
            if self.rank in self.servers:
                stats = self.server.serve()
                mine = {"applied": stats.applied, "dropped": stats.dropped, "staleness": stats.staleness,
                        "applied_by": stats.applied_by}
            else:
                worker = Worker(self.shards, self._compute, self.rank - len(self.servers))
                pushed = worker.run()
                mine = {"pushed": pushed, "wait_s": worker.wait_s}
        finally:
            if self.log is not None:
                self.log.close()
        mine["peak_memory_bytes"] = peak_memory_bytes("cpu")
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        return self._finish(everyone)

    def _layout(self) -> dict[str, int]:
        return {"world_size": dist.get_world_size(), **self.resolved.degrees}

    def _finish(self, everyone: list[dict]) -> dict[str, Any]:
        server0, workers = everyone[0], everyone[len(self.servers):]
        step_time = statistics.median(self.step_times[1:] or self.step_times) if self.step_times else None
        summary = run_summary(
            self.setup, self.val_loss, step_time, max(r["peak_memory_bytes"] for r in everyone), self._layout(), "cpu",
            False, tokens_per_step(self.batch, self.cfg.model.block_size),
            **{"async": {"servers": len(self.servers), "workers": len(self.workers),
                         "applied": server0["applied"], "dropped": server0["dropped"],
                         "staleness_mean": statistics.fmean(server0["staleness"]) if server0["staleness"] else 0.0,
                         "staleness_max": max(server0["staleness"], default=0),
                         "pushed": [w["pushed"] for w in workers],
                         "applied_by_worker": [server0["applied_by"].get(i, 0) for i in range(len(workers))],
                         "worker_wait_s": [round(w["wait_s"], 3) for w in workers]}})
        if self.rank == 0:
            write_summary(self.out_dir, summary)
        return summary
