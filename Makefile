# tandem — see README.md. Every target sets up what it needs first.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.stamp-setup

.PHONY: setup test serve model drafter bench loadtest soak genai-perf kernel-bench clean

# TORCH_INDEX=url: torch from that index first (e.g. https://download.pytorch.org/whl/cu128 for a CUDA 12.8 build;
# PyPI's own Linux wheels are CUDA builds too; docs/deploying.md)
$(STAMP): requirements.txt pyproject.toml
	@test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(if $(TORCH_INDEX),$(VPY) -m pip install -q --index-url $(TORCH_INDEX) torch==2.13.0)
	$(VPY) -m pip install -q -r requirements.txt
	$(VPY) -m pip install -q --no-deps --no-build-isolation -e .
	@touch $(STAMP)

BACKEND := triton_backends/.stamp-backend

# the Python backend folder tritonserver needs, assembled from the nvidia-pytriton wheel
$(BACKEND): $(STAMP)
	$(VPY) -m tandem.launch.serve backend-dir
	@touch $(BACKEND)

# the numba serving kernels compiled into their on-disk cache beside them (so no first request pays ~10 s);
# again when a kernel source (backend_src/tandem/ops/cpu) changes
WARM := $(VENV)/.stamp-warm
$(WARM): $(STAMP) $(wildcard backend_src/tandem/ops/cpu/*.py)
	$(VPY) -m tandem.model.warm
	@touch $(WARM)

# the ShareGPT turns the shipped drafters were distilled from, which the bench leaves out of its prompts, drawn
# once into ~/.cache/tandem (tandem.tools.distill.used_sharegpt_turns; ~15 s)
TURNS := $(VENV)/.stamp-turns
$(TURNS): $(STAMP) model_repository/weights/tandem-tiny/distill_report.json
	$(VPY) -c "from tandem.model.checkpoint import DEFAULT_CHECKPOINT as c; \
		from tandem.tools.distill import used_sharegpt_turns as u; print(f'tandem: {len(u(c))} distilled turns known')"
	@touch $(TURNS)

# HAProxy for the bounded HTTP front of every server (`make serve`, the test servers) and for `make serve-cluster`:
# Debian 12's haproxy 2.6 + the libraries it lacks here, fetched with apt-get download and unpacked under
# triton_backends/haproxy (no root install; once)
HAPROXY := triton_backends/haproxy/.stamp
$(HAPROXY): $(STAMP)
	$(VPY) -m tandem.launch.cluster install-haproxy

setup: $(STAMP) $(BACKEND) $(WARM) $(TURNS) $(HAPROXY)

# Triton on 127.0.0.1:8000 (HTTP) / 8001 (gRPC) / 8002 (metrics), HTTP and metrics through the bounded HAProxy
# front (tandem.launch.http_front), so even one server needs HAProxy: setup installs it; CHECKPOINT=dir overrides
# the weights
serve: setup
	$(VPY) -m tandem.launch.serve serve $(if $(CHECKPOINT),--checkpoint $(CHECKPOINT)) $(ARGS)

# REPLICAS tritonservers (server i: HTTP 9100+3i, gRPC +1, metrics +2) behind HAProxy on 127.0.0.1:9001 (installed
# by setup), sessions routed by a consistent hash of the x-tandem-session header; Ctrl-C stops everything
# (docs/deploying.md, "Replicas")
REPLICAS ?= 2
.PHONY: serve-cluster
serve-cluster: setup
	$(VPY) -m tandem.launch.cluster serve --replicas $(REPLICAS) $(if $(CHECKPOINT),--checkpoint $(CHECKPOINT)) $(ARGS)

# style by tools (ruff: pyproject.toml's [tool.ruff]), then the suite on two pytest-xdist workers with its 15 slowest
# tests listed: the files of tests that serve (tests/conftest.py, SERVED_FILES) run one after another on one
# worker, the other tests on both
test: setup
	$(VENV)/bin/ruff format --check --quiet .
	$(VENV)/bin/ruff check --quiet .
	$(VPY) -m pytest -q -n 2 --durations=15 tests

# trunk + MTP layer (ARGS go to tandem.tools.train), then the DFlash drafters distilled from it
model: setup
	$(VPY) -m tandem.tools.train $(ARGS)
	$(VPY) -m tandem.tools.distill $(DISTILL_ARGS)

# the DFlash / DFlash2 drafters alone, distilled from the checkpoint's trunk (DISTILL_ARGS: see --help)
drafter: setup
	$(VPY) -m tandem.tools.distill $(DISTILL_ARGS)

# the memory plan of a checkpoint (CHECKPOINT=dir; default: the real GLM-5.3-Flash config) on a group of devices
# (docs/deploying.md)
.PHONY: plan
plan: $(STAMP)
	$(VPY) -m tandem.tools.plan $(CHECKPOINT) $(ARGS)

# side-by-side benchmark; QUICK=1 for a smoke run, JSON=path to keep the figures
bench: setup
	$(VPY) -m tandem.tools.bench $(if $(QUICK),--quick) $(if $(JSON),--json $(JSON)) $(ARGS)

# Locust load test: ramp 1 -> USERS users (STEP_SECONDS s per step), MAX_TOKENS output tokens per turn at
# most; starts its own tritonserver unless URL=host:port; reports in reports/loadtest-<UTC time>/
USERS ?= 8
STEP_SECONDS ?= 30
MAX_TOKENS ?= 128
loadtest: setup
	$(VPY) -m loadtest.run --users $(USERS) --step-seconds $(STEP_SECONDS) --max-tokens $(MAX_TOKENS) \
		$(if $(URL),--url $(URL)) $(if $(TARGET),--target $(TARGET)) $(ARGS)

# soak: USERS users for SOAK_MINUTES with cancelled turns, multi-turn sessions and bad requests mixed in, plus one
# client cycling edge kinds (empty later turns, reused ids with cancels, cancels during prefill, long prompts beside
# short ones, max_tokens 1); fails on an unexpected error, a state gauge off baseline afterwards, or growing memory
# (reports/soak-<UTC time>/)
SOAK_MINUTES ?= 5
soak: setup
	$(VPY) -m loadtest.soak --minutes $(SOAK_MINUTES) --users $(USERS) $(ARGS)

# NVIDIA GenAI-Perf profiles the text ensemble over gRPC streaming, or with TARGET=openai the OpenAI front's chat
# completions (its own venv, .venv-genai, built on first use); starts its own tritonserver (and front) unless
# URL=host:port; CONCURRENCY, REQUESTS; artifacts in reports/genai-perf-<UTC time>/
CONCURRENCY ?= 4
REQUESTS ?= 24
genai-perf: setup
	$(VPY) -m loadtest.genai_perf --concurrency $(CONCURRENCY) --requests $(REQUESTS) --output-tokens $(MAX_TOKENS) \
		$(if $(URL),--url $(URL)) $(if $(TARGET),--target $(TARGET)) $(ARGS)

# each Triton kernel (backend_src/tandem/ops/triton/) against its torch reference on a GPU; without one it says so (ARGS=--cpu with
# TRITON_INTERPRET=1: an interpreter smoke run, agreement only)
kernel-bench: setup
	$(VPY) -m tandem.tools.kernel_bench $(ARGS)

# everything a machine with NVIDIA GPUs can check, in one run under 10 minutes (tandem.tools.gpu_check): the kernels
# compiled for sm_90, a CUDA torch in .venv-cuda (TORCH_INDEX), the kernel tests natively, kernel-bench, the miniature
# served on cuda against the CPU, a short bench; without a GPU it says so and runs the compile checks alone.
# Results in reports/gpu-check-<UTC time>/ (ARGS="--out DIR")
.PHONY: gpu-check
gpu-check: setup
	$(VPY) -m tandem.tools.gpu_check $(ARGS)

clean:
	rm -rf $(VENV) .venv-genai .venv-cuda triton_backends runs
