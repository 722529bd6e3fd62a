"""The engine layer: stages (trunk, drafters) keyed by sequence id, speculative sessions, the accept
walk and the scheduler that runs them in bursts. Triton-free; runs in-process and behind Triton."""
