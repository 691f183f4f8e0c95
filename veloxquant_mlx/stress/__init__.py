"""Concurrency testing of the block pool: stress runs, linearizability, systematic schedules.

Stress runs (``veloxquant-mlx stress``, or ``python -m stress`` from the repo):

- :mod:`~veloxquant_mlx.stress.config`: run options, operation mix, profiles;
- :mod:`~veloxquant_mlx.stress.workload`: what each thread does to the pool and store;
- :mod:`~veloxquant_mlx.stress.history`: the recorded concurrent history (a trace);
- :mod:`~veloxquant_mlx.stress.recording`: how a call is made and recorded;
- :mod:`~veloxquant_mlx.stress.specstep`, :mod:`~veloxquant_mlx.stress.linearizability`,
  :mod:`~veloxquant_mlx.stress.checker` and :mod:`~veloxquant_mlx.stress.minimal`:
  the Wing-Gong-Lowe checker against the executable spec, window by window,
  and the minimal failing window of a violation;
- :mod:`~veloxquant_mlx.stress.replay` and :mod:`~veloxquant_mlx.stress.reproducer`:
  the linearized history replayed on MLX storage, and reproducer files;
- :mod:`~veloxquant_mlx.stress.checking`: the checker thread, and the checking
  budget that bounds a run's wall time;
- :mod:`~veloxquant_mlx.stress.runner`, :mod:`~veloxquant_mlx.stress.watchdog`,
  :mod:`~veloxquant_mlx.stress.conservation`, :mod:`~veloxquant_mlx.stress.report`
  and :mod:`~veloxquant_mlx.stress.cli`: the run itself and its outputs.

Systematic schedules (every interleaving of small scenarios):
:mod:`~veloxquant_mlx.stress.schedules` on
:mod:`~veloxquant_mlx.stress.controlled_scheduler`, with its command line in
:mod:`~veloxquant_mlx.stress.schedules_command`.

Every command here gives one of the verdicts of
:mod:`veloxquant_mlx.commandline.verdicts` (OK only when everything was
checked) and its exit status.

Importing this package imports none of them (MLX loads only when a run needs it).
"""
