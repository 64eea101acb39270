"""The trainer Space: a training loop that publishes every optimizer step as an exact delta."""

from shared.openmp import bound_openmp_spin

# Before anything imports torch: its OpenMP workers would otherwise spin through the start of
# every publish() on a CPU trainer (see shared.openmp).
bound_openmp_spin()
