"""Tools that use the engine: training (``make model``), data, benchmark (``make bench``), evaluation."""
