"""The application: the learner loop (next batch → trainer step → publish → hooks), building a
run's components from a validated config, and run controls (stop signals, the non-finite-update
guard, timers). It sits above ``sat_jax.config`` and hands plain arguments down to
``sat_jax.rl``."""
