"""Run tooling: where a run lives (``workdir``), orbax save / restore of its state
(``checkpoint``), metrics files and TensorBoard (``metrics``), the progress line (``progress``)
and plots (``plots``)."""
