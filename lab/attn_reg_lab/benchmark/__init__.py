"""What the attention regularizers cost, measured against plain training in one process.

    attn-reg-benchmark                          # CPU, fp32: a few minutes on 2 cores
    attn-reg-benchmark --out bench.json         # also write the rows as JSON
    attn-reg-benchmark --device cuda --dtype bf16
    attn-reg-benchmark --quick                  # smoke run: tiny fairseq model, small batches

Workloads (one per framework and batch): a fairseq Transformer (6+6 layers, 512 wide, the
``transformer`` arch) on a batch of the shipped EN-RO corpus, and the real pretrained MiniLM
classifier through the transformers adapter on movie-review sentences. Every variant of a
workload runs on the same model, the same batch and the same random seed per round; the
variants of a workload are run round-robin (the order rotates each round) so machine drift
hits all of them alike, and after warm-up rounds the median step time is taken.

Memory: on CUDA, ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``; on
CPU, the peak of the bytes held by tensors that torch's CPU allocator handed out during the
step (torch.profiler's allocation events, ``profile_memory=True``), in separate profiled
runs that are not timed. Both are reported as the whole peak (what stays allocated between
steps -- weights, optimizer state -- plus the step's own peak) and as the step's own peak.

Adding a regularizer (in :mod:`.variants`) (AttendOut, scheduled attention dropout, attention LayerDrop, ...): write
one builder per framework, ``builder(bench, workload) -> Step``, and append a :class:`Variant`
to ``VARIANTS`` with the workload it runs on and its targets. A bench gives the builder what a
step needs: ``bench.model`` / ``bench.optimizer`` / ``bench.batches[workload]``, and
``FairseqBench.train_step(criterion, epoch, batch, stock=False)`` (fairseq-train's update with
any criterion) or ``HFBench.train_step(trainer, epoch, batch, stock=False)`` (a Trainer's
compute_loss, backward, optimizer step; every trainer built on the shared model drives the
same attention sites). For example, a
criterion-based regularizer::

    Variant("attendout", "AttendOut ...", "train",
            {"fairseq": lambda b, w: b.train_step(my_criterion(b.task), epoch=1, batch=w)},
            time_target=2.2, mem_target=2.2)

The runner, the table, the JSON and tests/lab/test_benchmark.py need nothing else.

Modules: :mod:`.variants` (what is measured), :mod:`.measure` (timing, memory, rows),
:mod:`.fairseq_bench` and :mod:`.hf_bench` (the two workloads), :mod:`.profile` (where the extra
time goes), :mod:`.report` (table, machine), :mod:`.cli` (the command).
"""

from .cli import main, parse_args  # noqa: E402,F401  (the package's public names)
from .measure import cpu_step_peak_bytes  # noqa: E402,F401
from .variants import DERIVED, VARIANTS, Variant  # noqa: E402,F401
