"""The executor: runs each scheduled step on the engine's ranks and returns what each
scheduled sequence drew.

One process: rank 0's ModelRunner prepares the step, runs the forward pass and samples.
Tensor parallelism (engine/parallel.py): the executor starts the worker processes of ranks
1..N-1 first (each loads its shard while rank 0 loads its own), then every step it hands
them the step's inputs before rank 0 runs its shard; a step that fails part way ends the
group, and `close` stops the workers.
"""

from __future__ import annotations

import torch

from pagecli.config import EngineConfig
from pagecli.engine.model_runner import (
    ModelRunner,
    collective_failure,
    collective_floats,
    rank_shard,
    runner_weight_plan,
)
from pagecli.engine.parallel import ParallelGroup, StepInputs, WorkerFailed, rank_device
from pagecli.engine.scheduler import SampledTokens, ScheduledBatch
from pagecli.loader.resolve import ModelSource


class Executor:
    """Rank 0's runner (`runner`: the model, its KV cache, its figures) and, with tensor
    parallelism, its workers (`parallel`)."""

    def __init__(
        self,
        config: EngineConfig,
        hf_config,
        source: ModelSource,
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int,
        draft_block_bytes: int = 0,
    ) -> None:
        size = config.tensor_parallel_size
        self.parallel: ParallelGroup | None = None
        plan = None
        if size > 1:
            first = rank_device(device, 0)
            plan = runner_weight_plan(config, source, first, dtype)
            if first.type == "cpu":
                from pagecli_kernels import native

                native.library()  # built once here, before the workers load it
            if plan.prepare is not None:
                plan.prepare()  # once here, not once per rank
            local = rank_shard(hf_config, size, plan, 0).local_config(hf_config)
            self.parallel = ParallelGroup(size, first, collective_floats(config, local))
            self.parallel.start(
                ModelRunner, config, hf_config, source, device, dtype, max_model_len
            )
        try:
            self.runner = ModelRunner(
                config,
                hf_config,
                source,
                device,
                dtype,
                max_model_len,
                draft_block_bytes=draft_block_bytes,
                plan=plan,
                parallel=self.parallel,
            )
        except BaseException:
            if self.parallel is not None:  # a failed start takes the workers with it
                self.parallel.close()
            raise

    def execute(self, batch: ScheduledBatch) -> list[SampledTokens]:
        """Forward the whole mixed batch once and sample, per scheduled sequence, the rows it
        asks for (ScheduledSeq.num_rows): what it drew, in batch.seqs order."""
        runner = self.runner
        with runner.step_kernels(batch):
            step = runner.prepare_step(batch)
            if self.parallel is None:
                logits = runner.forward(batch, step)
            else:
                inputs = (step.input_ids, step.positions, step.meta, step.sample_index)
                logits = self._run_ranks(StepInputs.from_step(*inputs, batch))
            return runner.sample(batch, step, logits)

    def _run_ranks(self, step: StepInputs) -> torch.Tensor | None:
        """Rank 0's tensor-parallel step: hand the workers `step`, run this rank's shard.

        A step that fails part way leaves the ranks out of step (a worker may wait in a
        collective this rank never reaches), so the group ends with it: WorkerFailed when a
        worker died or raised, else this rank's own error (a Ctrl-C, out of memory) after the
        workers are stopped; later steps raise WorkerFailed."""
        parallel = self.parallel
        if parallel.failure is not None:
            raise parallel.failure
        parallel.send(step)
        try:
            return self.runner.forward_logits(*step.tensors(self.runner.device))
        except BaseException as exc:
            if collective_failure(exc):
                error = parallel.failed()
            else:
                parallel.failure = WorkerFailed(
                    f"the tensor-parallel ranks stopped after a failed step ({type(exc).__name__})"
                )
                error = None
            self.close()
            if error is None:
                raise
            raise error from None

    def close(self) -> None:
        """Stop the tensor-parallel workers (a no-op without them): first end any collective
        they wait in, then ask them to stop, then kill what is left."""
        if self.parallel is not None:
            self.runner.abort()
            self.parallel.close()
