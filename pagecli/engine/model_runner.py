"""One rank's model and KV cache: flat batch tensors, the forward pass, sampling."""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from contextlib import AbstractContextManager, nullcontext

import numpy as np
import torch

from pagecli.config import EngineConfig
from pagecli.engine.cpu_threads import ThreadChoice, choose_threads
from pagecli.engine.kv_groups import plan_kv_groups
from pagecli.engine.parallel import (
    ParallelGroup,
    StepInputs,
    WorkerLink,
    attach_shm,
    join_group,
    pin_to_numa_node,
    rank_device,
)
from pagecli.engine.scheduler import SampledTokens, ScheduledBatch, ScheduledSeq
from pagecli.engine.spec_decode.invariance import verify_kernels
from pagecli.engine.spec_decode.verify import verify
from pagecli.engine.structured import BitmaskFiller
from pagecli.layers.attention import AttentionMetadata
from pagecli.layers.gated_delta import StateStore
from pagecli.layers.linear import bf16_rows_supported, packing_supported
from pagecli.layers.parallel import TensorParallel
from pagecli.layers.sampler import SamplingRow, compute_logprobs, sample
from pagecli.loader.resolve import ModelLoadError, ModelSource
from pagecli.loader.shards import RankShard, plan_shards
from pagecli.loader.weight_plan import WeightPlan, plan_weights
from pagecli.loader.weights import (
    KVCacheMemoryError,
    MemoryPlan,
    check_fits,
    check_kv_fits,
    check_memory_fits,
    init_dummy_weights,
    parameter_bytes,
    workspace_bytes,
)
from pagecli.models import weight_methods
from pagecli.models.base import CausalLM
from pagecli.models.registry import model_class
from pagecli_kernels.settings import apply as apply_kernel_settings


def keep_freed_memory() -> bool:
    """Ask glibc's malloc to keep freed memory instead of returning it to the kernel.

    Every step allocates activations and gathered K/V of many megabytes; by default glibc
    serves those with fresh mmap()s and unmaps them on free, so each step first-touches them
    again, one page fault per 4 KiB: the torch decode-attention path over 64 sequences of ~500
    tokens took 38.8 ms per layer that way and 16.0 ms with the pages kept (2 threads, this
    2-core CPU). Served from a heap that is never trimmed, the pages stay mapped between
    steps. The process keeps its peak memory, as any engine that preallocates does.
    A no-op (False) where the C library is not glibc.
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = libc.mallopt if libc is not None else None
    except (OSError, AttributeError):
        return False
    if mallopt is None:
        return False
    m_trim_threshold, m_top_pad, m_mmap_max = -1, -2, -4
    ok = mallopt(m_mmap_max, 0)  # no mmap()ed chunks: everything from the heap
    ok &= mallopt(m_trim_threshold, 2**31 - 1)  # never give the heap's top back
    ok &= mallopt(m_top_pad, 64 * 2**20)  # grow the heap in 64 MiB steps
    return bool(ok)


def release_freed_memory() -> bool:
    """Give the heap's free pages back to the kernel once (glibc's malloc_trim), after loading:
    parsing a GGUF file's metadata alone allocates ~150 MB of temporaries (the default model's
    49k-token vocabulary), which keep_freed_memory() would otherwise keep resident for good.
    A no-op (False) where the C library is not glibc."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return False
    return bool(trim(0)) if trim is not None else False


@dataclasses.dataclass
class PreparedStep:
    """One step made ready for the forward pass (ModelRunner.prepare_step): the flat inputs
    and attention metadata, the rows of the logits to sample ([S]), each scheduled
    sequence's first sampled row, and the structured outputs' mask being filled."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    sample_index: torch.Tensor  # [S]
    rows: list[int]
    mask: Future | None


class ModelRunner:
    """One rank's model and KV cache: a step's inputs (`prepare_step`), its forward pass
    (`forward`, or `forward_logits` on each tensor-parallel rank) and what each scheduled
    sequence drew (`sample`: a speculative decode's rows are checked against its drafts).
    The executor (engine/executor.py) puts the three together on the engine's ranks."""

    def __init__(
        self,
        config: EngineConfig,
        hf_config,
        source: ModelSource,
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int,
        link: WorkerLink | None = None,
        draft_block_bytes: int = 0,
        plan: WeightPlan | None = None,
        parallel: ParallelGroup | None = None,
    ) -> None:
        """`link`: this process is a tensor-parallel worker (engine/parallel.py), not rank 0;
        `parallel`: rank 0's handle on the workers the executor started (engine/executor.py),
        met once the weights are loaded. `plan`: the weight plan, where the caller made it.
        `draft_block_bytes`: a draft model's bytes per block id (speculative decoding), whose
        cache takes the same block ids out of the same --kv-cache-memory."""
        self.config = config
        self.draft_block_bytes = draft_block_bytes
        self.rank = link.rank if link is not None else 0
        size = config.tensor_parallel_size
        device = rank_device(device, self.rank) if size > 1 else device
        self.device = device
        self.dtype = dtype
        self.block_size = config.block_size
        self.vocab_size = hf_config.vocab_size  # the logits' width
        plan = plan or runner_weight_plan(config, source, device, dtype)
        self.weight_plan = plan
        self.tp: TensorParallel | None = None  # this rank's collectives (size > 1)
        self.parallel = parallel  # rank 0's handle on the workers
        if device.type == "cpu":
            # the C kernels take torch.get_num_threads() as their OpenMP thread count
            self.thread_choice = self._choose_threads()
            torch.set_num_threads(self.thread_choice.num_threads)
            keep_freed_memory()
            from pagecli_kernels import native

            native.library()  # build (once, ~1 s) or load the decode kernel now, not in step 1
        else:  # torch's own threads only serve the host side
            self.thread_choice = ThreadChoice(
                torch.get_num_threads(), f"torch's default (the model runs on {device.type})"
            )
        if config.kernels.changed():  # the defaults leave the process's choices as they are
            apply_kernel_settings(config.kernels)  # every rank: the workers are processes
        # speculative decoding: each step under the kernel choices that give a row the same
        # bits at one row and beside its drafts (spec_decode/invariance.py)
        self.spec = config.speculative_config if device.type == "cpu" else None
        # one sequence at a time: the integer paths at every batch (spec_decode/invariance.py)
        self.one_stream = device.type == "cpu" and config.max_num_seqs == 1
        if size > 1:
            shard = rank_shard(hf_config, size, plan, self.rank)
            self.tp = TensorParallel(shard)
            hf_config = shard.local_config(hf_config)
        self._build(hf_config, source, max_model_len, link)

    def _build(self, hf_config, source: ModelSource, max_model_len: int, link) -> None:
        """Load this rank's weights, meet the other ranks, allocate the KV cache."""
        config, device, dtype = self.config, self.device, self.dtype
        self.num_threads = torch.get_num_threads()
        model = self._meta_model(hf_config, max_model_len)
        layout = model.kv_layout()
        shapes = {(layer.num_kv_heads, layer.head_dim) for layer in layout}
        if len(shapes) != 1:  # one cache tensor of [layers, blocks, ...] holds them all
            raise ModelLoadError(
                f"{source.name}: layers with different KV shapes {sorted(shapes)} are not "
                "supported yet"
            )
        self.num_layers = len(layout)
        ((self.num_kv_heads, self.head_dim),) = shapes
        self.kv_groups = plan_kv_groups(
            [layer.window for layer in layout], max_model_len, config.hybrid_kv_cache
        )
        self.kv_slots = self.kv_groups.slots  # layers per page
        # recurrent layers (Gated DeltaNet): a state slot per running sequence and the state
        # snapshots for prefix hits, out of the KV cache's budget
        self.state_specs = [layer.spec for layer in model.state_layers]
        per_state = sum(spec.state_bytes(self.dtype) for spec in self.state_specs)
        self.num_state_slots = self.num_snapshots = 0
        if self.state_specs:
            self.num_state_slots, self.num_snapshots = self._plan_states(per_state)
        self.state_bytes = (self.num_state_slots + self.num_snapshots) * per_state
        if self.state_specs and config.tensor_parallel_size > 1:
            raise ModelLoadError(
                f"{source.name}: tensor parallelism over recurrent (Gated DeltaNet) layers is "
                "not supported yet"
            )
        if self.state_specs and config.speculative_config is not None:
            raise ModelLoadError(
                f"{source.name}: speculative decoding over recurrent (Gated DeltaNet) layers is "
                "not supported yet (their state cannot roll back rejected drafts)"
            )
        # the CPU's KV cache is sized by the flags alone: counted before the weights load
        self.num_blocks = self._num_blocks() if device.type == "cpu" else 0
        self.memory: MemoryPlan | None = None  # set by _load_model
        self.model = self._load_model(model, source)
        # the weights' bytes and those one decode token reads (a MoE's chosen experts only)
        self.weight_bytes, self.active_weight_bytes = weight_methods.decode_bytes(self.model)
        self._set_attention_impl(config.attention_impl)
        if device.type != "cpu":  # after the weights: the cache takes what they leave free
            self.num_blocks = self._num_blocks()
        if self.tp is not None:
            self._join_ranks(link)
        if device.type != "cpu" or self.tp is not None:
            self.memory = dataclasses.replace(self.memory, kv=self.num_blocks * self.block_bytes)
        # [K/V, slots, blocks, block_size, kv_heads, head_dim]: a layer reads its slot of the
        # blocks its group's table names (engine/kv_groups.py)
        self.kv_cache = torch.empty(
            2,
            self.kv_slots,
            self.num_blocks,
            self.block_size,
            self.num_kv_heads,
            self.head_dim,
            dtype=dtype,
            device=device,
        )
        placement = self.kv_groups.placement(self.num_layers)
        for layer, (group, slot) in zip(self.model.attention_layers, placement):
            layer.k_cache, layer.v_cache = self.kv_cache[0, slot], self.kv_cache[1, slot]
            layer.kv_group = group
        for layer in self.model.state_layers:
            layer.slots = StateStore.zeros(layer.spec, self.num_state_slots, dtype, device)
            layer.snapshots = StateStore.zeros(layer.spec, self.num_snapshots, dtype, device)
        # --swap-space: host slots for swapped-out sequences' states (at most half of it, one
        # per state slot), then host blocks
        swap_bytes = int(config.swap_space * 2**30)
        self.num_swap_states = 0
        if self.state_specs and swap_bytes:
            self.num_swap_states = min(self.num_state_slots, swap_bytes // 2 // per_state)
        for layer in self.model.state_layers:
            layer.host = StateStore.zeros(
                layer.spec, self.num_swap_states, dtype, "cpu", pin=device.type == "cuda"
            )
        swap_bytes -= self.num_swap_states * per_state
        self.allocate_swap(int(swap_bytes // (self.block_bytes + self.draft_block_bytes)))
        self.generator = torch.Generator(device=device).manual_seed(config.seed)
        self.max_blocks_per_seq = -(-max_model_len // self.block_size)
        self._buffers: dict | None = None  # the CPU's step metadata buffers, made on first use
        self._bitmask: BitmaskFiller | None = None  # made at the first constrained step
        self.graphs = None
        # CUDA graphs capture the Triton kernels; the other paths read lengths on the host
        # (not under tensor parallelism: the captured graphs would hold the collectives too)
        graphable = (
            config.attention_impl in ("auto", "triton")
            and self.tp is None
            and not self.state_specs  # the recurrent layers index their slots on the host
        )
        if device.type == "cuda" and not config.enforce_eager and graphable:
            from pagecli.engine.cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(
                self.model,
                config.max_num_seqs,
                self.max_blocks_per_seq,
                self.kv_groups.num_groups,
                hf_config.hidden_size,
                dtype,
                device,
            )

    def allocate_swap(self, num_blocks: int) -> None:
        """Host blocks for swapped-out sequences (a draft model's cache takes the target's
        count: a swap moves both caches' blocks of one sequence)."""
        self.num_swap_blocks = num_blocks
        self.swap_cache = None
        if num_blocks:
            self.swap_cache = torch.empty(
                2,
                self.kv_slots,
                num_blocks,
                self.block_size,
                self.num_kv_heads,
                self.head_dim,
                dtype=self.dtype,
                device="cpu",
                pin_memory=self.device.type == "cuda",
            )

    # ---- set-up --------------------------------------------------------------------------

    def _choose_threads(self) -> ThreadChoice:
        """`--threads` per process; by default each tensor-parallel rank takes an equal share
        of the cores (with `--numa`, the cores of its own node)."""
        size = self.config.tensor_parallel_size
        if self.config.numa:
            pin_to_numa_node(self.rank, size)
        choice = choose_threads(self.config.num_threads)
        if size == 1 or self.config.num_threads is not None:
            return choice
        if self.config.numa:
            return ThreadChoice(choice.num_threads, f"{choice.reason}, on NUMA node {self.rank}")
        share = max(1, choice.num_threads // size)
        return ThreadChoice(share, f"{choice.reason}, shared by {size} tensor-parallel ranks")

    def _join_ranks(self, link: WorkerLink | None) -> None:
        """Meet the other ranks once every shard is loaded: the process group, then one
        block count for all (the smallest: block ids are shared)."""
        if link is None:
            self.parallel.wait_loaded()
            self.parallel.start_join()
            init_file = self.parallel.init_file
        else:
            link.conn.send(("loaded",))
            if link.conn.recv() != ("join",):
                raise ModelLoadError("rank 0 did not ask to join")
            init_file = link.init_file
        join_group(self.rank, self.config.tensor_parallel_size, init_file, self.device)
        self.num_blocks = self.tp.min_over_ranks(self.num_blocks, self.device)
        attach_shm(self.tp, link or self.parallel, self.device)
        self.tp.min_over_ranks(0, self.device)  # a barrier: every rank has mapped the files
        if self.parallel is not None:
            self.parallel.release_files()
            self.parallel.on_failure(lambda error: self.tp.abort())
            self.parallel.watch()

    def abort(self) -> None:
        """End any collective this rank's peers wait in (a no-op with one rank)."""
        if self.tp is not None:
            self.tp.abort()

    def _meta_model(self, hf_config, max_model_len: int) -> CausalLM:
        """The model on the meta device, its layers already in their weights' formats (no
        float copy of a quantized weight is ever made)."""
        plan = self.weight_plan
        cls = model_class(hf_config)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device("meta"):
                model = cls(hf_config, max_position=max_model_len, tp=self.tp)
                weight_methods.use_quantized(model, plan.quantized_names)
                if plan.qk_pairs:
                    model.use_qk_pairs()  # the file's Q/K rows read in place
        except ValueError as exc:  # what the family cannot build from this checkpoint
            raise ModelLoadError(f"{exc}") from None
        finally:
            torch.set_default_dtype(previous)
        return model

    def _load_model(self, model: CausalLM, source: ModelSource) -> CausalLM:
        """Check the memory plan, then materialize `model` (meta) and load its weights."""
        load_format = self.config.load_format
        dummy = load_format == "dummy" or not source.has_weights
        plan = self.weight_plan
        weights = plan.resident_bytes
        if weights is None:  # every parameter in the model's own dtypes
            weights = parameter_bytes(model)
        check_fits(weights, self.dtype, self.device, source.name, plan.resident_bytes is None)
        config = self.config
        self.memory = MemoryPlan(
            mapped=plan.mapped_bytes,
            anonymous=weights - plan.mapped_bytes,
            kv=self.num_blocks * self.block_bytes,
            states=self.state_bytes,
            states_layout=f"{self.num_state_slots} slots + {self.num_snapshots} snapshots",
            swap=int(config.swap_space * 2**30 // self.block_bytes) * self.block_bytes,
            kv_layout=self.kv_groups.describe() if self.kv_groups.hybrid else "",
            workspace=workspace_bytes(
                model, config.max_num_batched_tokens, config.max_num_seqs, self.dtype
            ),
        )
        if self.device.type == "cpu":
            check_memory_fits(self.memory, self.device, *self._kv_flag())
        # what Module.to_empty does, but contiguous: empty_like on meta tensors imports sympy
        model = model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=self.device))
        for rotary in model.rotary.values():
            rotary.to_device(self.device, self.dtype)
        if dummy:
            if load_format not in ("dummy", "auto"):
                raise ModelLoadError(f"{source.name}: has no weights; use --load-format dummy")
            init_dummy_weights(model, self.config.seed)
        else:
            shard = self.tp.shard if self.tp is not None else None
            weights = plan.shard_weights(shard, _cut_of(model, shard))
            try:
                with torch.no_grad():
                    weight_methods.load_weights(model, weights)
            except ValueError as exc:  # a missing, unexpected or misshapen tensor
                raise ModelLoadError(f"{source.name}: {exc}") from None
        model.post_load()
        if packing_supported(self.dtype, self.device):
            saved = weight_methods.prepare_float32(model)  # bfloat16 checkpoints' rows kept
            if saved:  # the fit was checked at float32's size: what loading them takes
                memory = self.memory
                self.memory = dataclasses.replace(memory, anonymous=memory.anonymous - saved)
        elif bf16_rows_supported(self.dtype, self.device):
            weight_methods.prepare_bfloat16(model)
        if self.device.type == "cpu":
            import gc

            gc.collect()
            release_freed_memory()
        return model.eval()

    def _set_attention_impl(self, impl: str) -> None:
        """Point every attention layer, every recurrent layer's recurrence and every MoE's
        routed experts at the kernels of `attention_impl`."""
        import os

        if impl == "triton" and self.device.type == "cpu":
            if os.environ.get("TRITON_INTERPRET") != "1":
                raise ValueError(
                    "attention_impl triton on the CPU runs Triton's interpreter: set "
                    "TRITON_INTERPRET=1 (it is for tests: slow)"
                )
            try:
                import triton  # noqa: F401
            except ImportError:
                raise ValueError("attention_impl triton needs the triton package") from None
        if impl == "triton" or (impl == "auto" and self.device.type == "cuda"):
            from pagecli_kernels._triton_utils import check_triton_support

            head_dim = self.model.attention_layers[0].head_dim
            check_triton_support(head_dim, self.block_size)  # fail at start, not in step 1
        for layer in self.model.attention_layers:
            layer.impl = impl
        for layer in self.model.state_layers:  # the DeltaNet recurrence's kernels
            layer.impl = impl
        for layer in self.model.moe_layers:  # the routed experts' kernels
            layer.impl = impl

    def _plan_states(self, per_state: int) -> tuple[int, int]:
        """(state slots, state snapshots): a slot per --max-num-seqs and the snapshots asked
        for (default one per 8 slots, at least 4; none without a stride or prefix caching).
        On the CPU they take at most half of --kv-cache-memory: fewer slots where a slot
        per --max-num-seqs would not fit (sequences past them wait for one)."""
        config = self.config
        slots = config.max_num_seqs
        snapshots = 0
        if config.state_snapshot_stride and config.enable_prefix_caching:
            snapshots = config.state_snapshots
        if self.device.type != "cpu" or config.num_kv_blocks is not None:
            return slots, max(4, slots // 8) if snapshots is None else snapshots
        room = int(config.kv_cache_memory * 2**30 / 2 // per_state)
        if snapshots is None:
            snapshots = max(4, min(slots, room) // 8)
        slots = min(slots, room - snapshots)
        if slots < 1:
            raise KVCacheMemoryError(
                f"--kv-cache-memory {config.kv_cache_memory:g} GiB does not hold a state slot "
                f"per sequence and {snapshots} state snapshots in half of it (states of "
                f"{per_state / 2**20:.2f} MiB); raise --kv-cache-memory or lower "
                "--state-snapshots"
            )
        return slots, snapshots

    @property
    def block_bytes(self) -> int:
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.kv_slots * self.block_size * self.num_kv_heads * self.head_dim * elem

    def _kv_flag(self) -> tuple[str, str]:
        """The option that sizes the KV cache, and its value as given."""
        config = self.config
        if config.num_kv_blocks is not None:
            return "--num-kv-blocks", str(config.num_kv_blocks)
        if self.device.type == "cuda":
            return "--gpu-memory-utilization", str(config.gpu_memory_utilization)
        return "--kv-cache-memory", f"{config.kv_cache_memory:g}"

    def _num_blocks(self) -> int:
        """KV blocks from the memory budget, checked against the memory really available
        (device memory for the cache, host memory for the swap space) before anything is
        allocated: KVCacheMemoryError, one line naming the flag to change."""
        config = self.config
        swap_bytes = int(config.swap_space * 2**30)
        flag, value = self._kv_flag()
        if config.num_kv_blocks is not None:
            num_blocks = config.num_kv_blocks
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            headroom = (1 - config.gpu_memory_utilization) * total + 2**30  # activations
            num_blocks = int((free - headroom - self.state_bytes) // self.block_bytes)
            if num_blocks < 1:
                util = config.gpu_memory_utilization
                raise KVCacheMemoryError(
                    f"no room for the KV cache: --gpu-memory-utilization {util} of "
                    f"{total / 2**30:.1f} GiB, less 1 GiB for activations, leaves "
                    f"{(free - headroom) / 2**30:.1f} GiB of the {free / 2**30:.1f} GiB free; "
                    "raise --gpu-memory-utilization"
                )
        else:
            budget = config.kv_cache_memory * 2**30 - self.state_bytes
            num_blocks = int(budget // (self.block_bytes + self.draft_block_bytes))
            if self.state_specs and num_blocks < 1:
                slots = self.num_state_slots + self.num_snapshots
                per_slot = self.state_bytes / slots / 2**20
                raise KVCacheMemoryError(
                    f"--kv-cache-memory {value} GiB does not hold a state slot per sequence "
                    f"and the state snapshots ({slots} x {per_slot:.2f} MiB: --max-num-seqs "
                    f"{self.num_state_slots}, --state-snapshots {self.num_snapshots}) and one "
                    "KV block "
                    f"({self.block_bytes / 2**20:.2f} MiB); raise --kv-cache-memory or lower "
                    "--max-num-seqs"
                )
            if num_blocks < 1:
                raise KVCacheMemoryError(
                    f"--kv-cache-memory {value} GiB is less than one KV block "
                    f"({self.block_bytes / 2**20:.2f} MiB); raise --kv-cache-memory"
                )
        kv_bytes = num_blocks * self.block_bytes + self.state_bytes
        check_kv_fits(kv_bytes, swap_bytes, self.device, flag, value)
        return num_blocks

    # ---- one step ------------------------------------------------------------------------

    def step_kernels(self, batch: ScheduledBatch) -> AbstractContextManager:
        """The kernel choices a step runs under: with speculative decoding, those that give
        each row the bits it has alone; in an engine of one sequence at a time, the integer
        paths (spec_decode/invariance.py); else the process's."""
        rows = sum(s.num_new_tokens for s in batch.seqs)
        return self.step_kernels_for(rows, any(s.draft_token_ids for s in batch.seqs))

    def step_kernels_for(self, rows: int, drafts: bool) -> AbstractContextManager:
        """The same, for a step of `rows` rows, with drafts or not (bench reports a decode
        step's)."""
        if self.spec is None and not self.one_stream:
            return nullcontext()
        return verify_kernels(rows, drafts, self.one_stream)

    @torch.inference_mode()
    def prepare_step(self, batch: ScheduledBatch) -> PreparedStep:
        """Everything before the forward pass: the block and state copies, the structured
        outputs' mask (filled on its own thread meanwhile), the flat inputs."""
        self.copy_blocks(batch.swap_out, batch.swap_in, batch.block_copies)
        self._copy_states(batch)
        items = batch.seqs
        rows = self._row_starts(items)
        constrained = [  # a decode's drafts (forced tokens) need a mask for each of its rows
            (rows[i], s.seq.matcher, s.draft_token_ids)
            for i, s in enumerate(items)
            if s.num_rows and s.seq.matcher is not None
        ]
        mask = self.bitmask.start(constrained) if constrained else None
        input_ids, positions, meta, sample_index = self._prepare(batch)
        return PreparedStep(input_ids, positions, meta, sample_index, rows, mask)

    @torch.inference_mode()
    def forward(self, batch: ScheduledBatch, step: PreparedStep) -> torch.Tensor | None:
        """This process's forward pass over the whole step (one rank): the sampled rows'
        logits ([S, V]; None when nothing is sampled)."""
        meta = step.meta
        if (
            self.graphs is not None
            and not batch.prefills
            and self.graphs.padded_size(meta.num_decode_tokens)
        ):
            hidden = self.graphs.run(  # [T, H]
                step.input_ids,
                step.positions,
                meta.slot_mapping,
                meta.decode_block_tables,
                meta.decode_seq_lens,
            )
        else:
            hidden = self.model(step.input_ids, step.positions, meta)  # [T, H]
        for layer in self.model.state_layers:  # states at a snapshot boundary
            layer.snapshots.copy_(batch.snapshot_saves, layer.slots)
        if not step.sample_index.numel():
            return None
        return self.model.compute_logits(hidden[step.sample_index])  # [S, V]

    @torch.inference_mode()
    def sample(
        self, batch: ScheduledBatch, step: PreparedStep, logits: torch.Tensor | None
    ) -> list[SampledTokens]:
        """What each scheduled sequence drew from the step's logits, in batch.seqs order."""
        return self._sample(batch.seqs, step.rows, logits, step.mask)

    @staticmethod
    def _row_starts(items: list[ScheduledSeq]) -> list[int]:
        """Each item's first row among the step's sampled logits (items that sample no row
        get the next item's)."""
        starts, row = [], 0
        for item in items:
            starts.append(row)
            row += item.num_rows
        return starts

    @torch.inference_mode()
    def forward_logits(self, input_ids, positions, meta, sample_index) -> torch.Tensor | None:
        """The tensor-parallel forward pass: this rank's shard, then the sampled rows'
        logits joined on rank 0 ([S, V]; None elsewhere, or when nothing is sampled)."""
        hidden = self.model(input_ids, positions, meta)  # [T, H]
        if sample_index.numel() == 0:
            return None
        logits = self.model.compute_logits(hidden[sample_index])  # [S, rows of this rank]
        return self.tp.gather_logits(logits, self.vocab_size)

    @torch.inference_mode()
    def run_worker_step(self, step: StepInputs) -> None:
        """A worker rank's part of one step (rank 0 sent `step`)."""
        self.copy_blocks(step.swap_out, step.swap_in, step.block_copies)
        with self.step_kernels_for(len(step.input_ids), step.drafts):
            self.forward_logits(*step.tensors(self.device))

    def _sample(self, items, rows, logits, mask) -> list[SampledTokens]:
        """Draw each item's tokens: one row per decode or finished prefill (n ids for a
        request's first tokens with n > 1), and for a decode with k drafts its k + 1 rows in
        order, each drawn with the request's own sampler as if decoded alone, accepted while
        the draw equals the draft, or by rejection sampling where a draft model drew the
        drafts from its distribution (engine/spec_decode/verify.py)."""
        if logits is None:
            return [SampledTokens() for _ in items]
        raw_logits = logits
        if mask is not None:
            # logprobs report the model's own distribution, as without a grammar (vLLM's
            # default too): they read the logits from before the mask
            constrained_logprobs = (
                s.seq.matcher is not None and s.seq.sampling_params.logprobs is not None
                for s in items
            )
            if any(constrained_logprobs):
                raw_logits = logits.clone()
            BitmaskFiller.apply(logits, mask)
        plain = [i for i, s in enumerate(items) if s.num_rows and not s.draft_token_ids]
        out = [SampledTokens() for _ in items]
        if plain:
            index = [rows[i] for i in plain]
            every_row = len(index) == logits.shape[0]
            picked = logits if every_row else logits[index]
            picked_raw = raw_logits if every_row else raw_logits[index]
            sampling_rows = [self._sampling_row(items[i]) for i in plain]
            drawn = sample(picked, sampling_rows, self.generator)
            logprobs = compute_logprobs(picked_raw, sampling_rows, drawn)
            for i, ids, lp in zip(plain, drawn, logprobs):
                out[i] = SampledTokens(ids, lp)
        for i, item in enumerate(items):
            if item.draft_token_ids:
                out[i] = verify(
                    logits[rows[i] : rows[i] + item.num_rows],
                    item.seq,
                    item.draft_token_ids,
                    self.generator,
                    item.draft_probs,
                )
        return out

    @property
    def bitmask(self) -> BitmaskFiller:
        """The token-mask filler of structured outputs: a row per constrained sequence, and
        one per draft it carries."""
        if self._bitmask is None:
            self._bitmask = BitmaskFiller(self.vocab_size, self.num_threads)
        return self._bitmask

    def _sampling_row(self, item: ScheduledSeq) -> SamplingRow:
        seq = item.seq
        # A sequence pending its fork (n > 1) draws all n first tokens from one row.
        generators = seq.generators if seq.pending_fork else seq.generators[:1]
        return SamplingRow(
            seq.sampling_params, generators, seq.prompt_token_ids, seq.output_token_ids
        )

    def _host_buffers(self, num_tokens: int, num_rows: int) -> dict:
        """Step metadata buffers, allocated once and grown only if a step needs more: numpy
        arrays that the step fills and torch tensors over the same memory. A step's tensors
        are slices of these, valid until the next step (on the CPU the model reads them in
        place; other devices get copies)."""
        groups, width = self.kv_groups.num_groups, self.max_blocks_per_seq
        shapes = {
            "input_ids": ((num_tokens,), np.int64),
            "positions": ((num_tokens,), np.int64),
            "slots": ((groups, num_tokens), np.int64),
            "sample_index": ((num_rows,), np.int64),
            "decode_tables": ((groups, num_rows, width), np.int32),
            "decode_lens": ((num_rows,), np.int32),
            "prefill_tables": ((groups, num_rows, width), np.int32),
            "prefill_lens": ((num_rows,), np.int32),
            "query_start": ((num_rows + 1,), np.int32),
        }
        return {name: np.zeros(shape, dtype) for name, (shape, dtype) in shapes.items()}

    def _prepare(self, batch: ScheduledBatch):
        """The step's flat tensors: decode rows first (a decode with k drafts is k + 1 rows,
        each a decode of its own position with the sequence's block table, so that each
        row's attention is the one decoding alone would run), then the prefill chunks back
        to back. Written into the persistent host buffers; copied to the device if it is
        not the CPU."""
        decodes, prefills = batch.decodes, batch.prefills
        num_decode_rows = sum(item.num_new_tokens for item in decodes)
        num_rows = num_decode_rows + len(prefills)
        num_tokens = num_decode_rows + sum(item.num_new_tokens for item in prefills)
        # A step holds at most max_num_seqs sequences and max_num_batched_tokens tokens, except
        # when the forks of n > 1 requests join the running batch past the first budget.
        if (
            self._buffers is None
            or num_rows > len(self._buffers["sample_index"])
            or num_tokens > len(self._buffers["input_ids"])
        ):
            self._buffers = self._host_buffers(
                max(num_tokens, self.config.max_num_batched_tokens),
                max(num_rows, self.config.max_num_seqs),
            )
        buf, bs = self._buffers, self.block_size
        input_ids, positions, slots = buf["input_ids"], buf["positions"], buf["slots"]
        sample_index = buf["sample_index"]
        decode_tables, decode_lens = buf["decode_tables"], buf["decode_lens"]
        d_width = max((len(item.seq.block_table) for item in decodes), default=0)
        r = num_sampled = 0
        for item in decodes:  # one token each (plain stores are cheapest), then its drafts
            seq = item.seq
            tables = seq.block_tables
            n = len(tables[0])
            pos = seq.num_computed_tokens
            sampled = item.num_rows > 0  # not a prompt's one-token chunk short of its end
            for j, token in enumerate([seq.token_ids[pos], *item.draft_token_ids]):
                p = pos + j
                input_ids[r] = token
                positions[r] = p
                for g, table in enumerate(tables):
                    slots[g, r] = table[p // bs] * bs + p % bs
                    decode_tables[g, r, :n] = table
                    decode_tables[g, r, n:d_width] = 0
                decode_lens[r] = p + 1
                if sampled:
                    sample_index[num_sampled] = r
                    num_sampled += 1
                r += 1
        num_tokens = num_decode_rows
        starts = buf["query_start"]
        starts[0] = 0
        prefill_tables, prefill_lens = buf["prefill_tables"], buf["prefill_lens"]
        p_width = max((len(item.seq.block_table) for item in prefills), default=0)
        for j, item in enumerate(prefills):
            seq = item.seq
            start, n = seq.num_computed_tokens, item.num_new_tokens
            end = num_tokens + n
            input_ids[num_tokens:end] = seq.token_ids[start : start + n]
            pos = np.arange(start, start + n)
            positions[num_tokens:end] = pos
            for g, group_table in enumerate(seq.block_tables):
                table = np.asarray(group_table, dtype=np.int64)
                slots[g, num_tokens:end] = table[pos // bs] * bs + pos % bs
                prefill_tables[g, j, : len(table)] = table
                prefill_tables[g, j, len(table) : p_width] = 0
            starts[j + 1] = starts[j] + n
            prefill_lens[j] = start + n
            if item.completes_prefill:
                sample_index[num_sampled] = end - 1
                num_sampled += 1
            num_tokens = end

        dev = self._on_device
        num_p = len(prefills)
        meta = AttentionMetadata(
            slot_mapping=dev(slots[:, :num_tokens]),  # [G, T]
            num_decode_tokens=num_decode_rows,
            decode_block_tables=(  # [G, D, W]
                dev(decode_tables[:, :num_decode_rows, :d_width]) if decodes else None
            ),
            decode_seq_lens=dev(decode_lens[:num_decode_rows]) if decodes else None,
            prefill_block_tables=(  # [G, P, W]
                dev(prefill_tables[:, :num_p, :p_width]) if prefills else None
            ),
            prefill_seq_lens=dev(prefill_lens[:num_p]) if prefills else None,
            prefill_query_start_loc=dev(starts[: num_p + 1]) if prefills else None,
            long_rope_rows=self._long_rope_rows(batch),
            state_slots=self._state_slots(batch),
            state_starts=self._state_starts(batch),
        )
        return (
            dev(input_ids[:num_tokens]),  # [T]
            dev(positions[:num_tokens]),  # [T]
            meta,
            dev(sample_index[:num_sampled]),  # [S]
        )

    def _on_device(self, array) -> torch.Tensor:
        """A host buffer's slice as a tensor on the model's device: the buffer itself on the
        CPU, else a pinned copy sent without a sync (the buffer is rewritten next step)."""
        tensor = torch.from_numpy(array)
        if self.device.type == "cpu":
            return tensor
        return tensor.pin_memory().to(self.device, non_blocking=True)

    def _long_rope_rows(self, batch: ScheduledBatch):
        """For a LongRoPE model, the step's tokens that rotate with its long-context table:
        every token of a sequence longer than the original context, as transformers rotates
        it (the scheduler recomputes a sequence whole when it grows past it, and keeps drafts
        short of that point); [T] bool, or None for other models."""
        start = self.model.long_rope_from
        if start is None:
            return None
        flags = []
        for item in batch.seqs:
            flags += [item.seq.num_tokens > start] * item.num_new_tokens
        return self._on_device(np.asarray(flags, dtype=np.bool_))  # [T]

    def cache_salt(self, num_tokens: int) -> int:
        """The prefix-cache salt of a new sequence (engine/sequence.py): a LongRoPE model's
        long sequences are rotated with other factors, so their blocks never meet the rest."""
        start = self.model.long_rope_from
        return 1 if start is not None and num_tokens > start else 0

    def _copy_states(self, batch: ScheduledBatch) -> None:
        """Every recurrent layer's states before the forward: swap-outs first (their slots
        may be reused in this step), swap-ins, forked samples' copies, prefix hits' snapshots;
        each a list of (from, to) entries."""
        for layer in self.model.state_layers:
            layer.host.copy_(batch.state_swap_out, layer.slots)
            layer.slots.copy_(batch.state_swap_in, layer.host)
            layer.slots.copy_(batch.state_copies, layer.slots)
            layer.slots.copy_(batch.state_restores, layer.snapshots)

    def _state_slots(self, batch: ScheduledBatch) -> torch.Tensor | None:
        """The step's sequences' state slots (decodes, then prefills: the order of their
        rows); the slots of sequences that start here are zeroed first."""
        if not self.state_specs:
            return None
        items = [*batch.decodes, *batch.prefills]
        if any(item.draft_token_ids for item in batch.decodes):
            raise RuntimeError("recurrent layers take no drafts")
        slots = [item.seq.state_slot for item in items]
        fresh = [item.seq.state_slot for item in items if item.seq.num_computed_tokens == 0]
        for layer in self.model.state_layers:
            layer.slots.zero_(fresh)
        return torch.tensor(slots, dtype=torch.int64, device=self.device)  # [S]

    def _state_starts(self, batch: ScheduledBatch) -> torch.Tensor | None:
        """The first token of each of the step's sequences, in `_state_slots`' order, and the
        step's token count last ([S + 1] int32); None for models without recurrent layers."""
        if not self.state_specs:
            return None
        counts = [1] * len(batch.decodes) + [item.num_new_tokens for item in batch.prefills]
        starts = np.zeros(len(counts) + 1, dtype=np.int32)
        np.cumsum(counts, out=starts[1:])
        return self._on_device(starts)

    def copy_blocks(self, swap_out, swap_in, block_copies) -> None:
        """Swap-outs first (their device blocks may be reused in this very step), then
        swap-ins, then copy-on-write copies; each a list of (from, to) block ids."""
        if swap_out:
            dev_ids = torch.tensor([d for d, _ in swap_out], device=self.device)
            host_ids = torch.tensor([h for _, h in swap_out])
            self.swap_cache[:, :, host_ids] = self.kv_cache[:, :, dev_ids].to("cpu")
        if swap_in:
            host_ids = torch.tensor([h for h, _ in swap_in])
            dev_ids = torch.tensor([d for _, d in swap_in], device=self.device)
            self.kv_cache[:, :, dev_ids] = self.swap_cache[:, :, host_ids].to(self.device)
        if block_copies:
            src = torch.tensor([s for s, _ in block_copies], device=self.device)
            dst = torch.tensor([d for _, d in block_copies], device=self.device)
            self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]


def _cut_of(model: CausalLM, shard: RankShard | None):
    """checkpoint name -> this rank's cut of it (loader/shards.py), from the splits the
    model's layers declare; None without tensor parallelism."""
    if shard is None:
        return None

    def cut_of(name: str):
        found = weight_methods.split_of(model, name)
        if found is None:
            return None  # not the model's: the load names it
        split, target = found
        parts = None if target.first is None else range(target.first, target.first + target.count)
        return shard.cut(split, parts, bias=target.leaf == "bias")

    return cut_of


def runner_weight_plan(config: EngineConfig, source: ModelSource, device, dtype) -> WeightPlan:
    """How a runner holds the checkpoint's weights (loader/weight_plan.py)."""
    dummy = config.load_format == "dummy" or not source.has_weights
    return plan_weights(source, "none" if dummy else config.quantization, device, dtype)


def rank_shard(hf_config, size: int, plan: WeightPlan, rank: int) -> RankShard:
    """Rank `rank`'s part of the weights under tensor parallelism at `size`."""
    return plan_shards(hf_config, size, _row_blocks(hf_config, plan))[rank]


def _row_blocks(hf_config, plan: WeightPlan) -> dict[str, int]:
    """For each axis row-parallel weights are cut along, the widest block (values) of the
    block-format tensors cut along it: columns a tensor-parallel split must not cut."""
    cls = model_class(hf_config)  # outside the meta context: it checks RoPE tables on the CPU
    with torch.device("meta"):
        probe = cls(hf_config, max_position=1)
    blocks: dict[str, int] = {}
    for name, values in plan.block_values.items():
        found = weight_methods.split_of(probe, name)
        if found is not None and found[0].kind == "row":
            axis = found[0].segments[0][0]
            blocks[axis] = max(blocks.get(axis, 1), values)
    return blocks


def collective_floats(config: EngineConfig, hf_config) -> int:
    """Floats of one rank's slot for the CPU's shared-memory collectives: a step's hidden
    states ([tokens, hidden]) or its sampled rows' logits ([seqs, vocab rows of a rank])."""
    size = config.tensor_parallel_size
    hidden = hf_config.hidden_size * config.max_num_batched_tokens
    logits = -(-hf_config.vocab_size // size) * config.max_num_seqs
    return max(hidden, logits)


def collective_failure(exc: BaseException) -> bool:
    """Whether a tensor-parallel step failed in a collective (a peer gone or aborted), not in
    this rank's own work."""
    import torch.distributed as dist

    from pagecli_kernels.shm_collective import CollectiveError

    if isinstance(exc, (CollectiveError, dist.DistError)):
        return True
    text = str(exc).lower()  # gloo's transport errors come as plain RuntimeErrors
    return isinstance(exc, RuntimeError) and ("gloo" in text or "connection" in text)
