"""tandem's Locust load test: ShareGPT-shaped traffic (:mod:`loadtest.workload`), the Locust User
and ramp shape (``loadtest/locustfile.py``), the report (:mod:`loadtest.report`) and the runner
(``python -m loadtest.run``, ``make loadtest``)."""
