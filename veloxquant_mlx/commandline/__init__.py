"""What every command of this package shares: verdicts, exit statuses, bad input, Ctrl-C, files.

- :mod:`~veloxquant_mlx.commandline.verdicts`: OK, violation, inconclusive,
  interrupted; the exit status of each (0, 1, 3, 130; bad input is 2), and
  the :class:`~veloxquant_mlx.commandline.verdicts.Gap` an inconclusive
  checker reports;
- :mod:`~veloxquant_mlx.commandline.bad_input`: one-line usage errors, and
  refusing input that cannot fit in memory before allocating it;
- :mod:`~veloxquant_mlx.commandline.values`: the types of numeric options
  (bounded ints, finite numbers);
- :mod:`~veloxquant_mlx.commandline.sizes`: the measured figures behind the
  memory estimates;
- :mod:`~veloxquant_mlx.commandline.interrupts`: Ctrl-C as one line and
  status 130, also in runs with worker threads, on the one SIGINT handler
  of :mod:`~veloxquant_mlx.commandline.sigint`, which the thin entry
  points install before the heavy imports;
- :mod:`~veloxquant_mlx.commandline.files`: atomic writes and a safe ``--out``.

The commands (``veloxquant-mlx simulate|stress``, ``python -m stress``,
``python -m veloxquant_mlx.testing.aliasing``, ``...testing.exhaustive``,
``...stress.schedules``, ``...stress.finaliser_schedules``) derive their
behaviour from these modules, so the table of exit statuses exists once.
"""
