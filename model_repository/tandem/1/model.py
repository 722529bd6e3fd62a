"""Triton adapter for the decoupled `tandem` model: requests -> tandem.bls.TurnRequest ->
tandem.front.TandemFront (scheduler + worker thread over BLS proxies); receipts -> streamed responses."""

import json

import triton_python_backend_utils as pb_utils

from tandem import bls
from tandem.config import TrunkConfig
from tandem.front import TandemFront
from tandem.tokenizer import ChatTokenizer

INPUTS = ("INPUT_IDS", "MAX_TOKENS", "SPEC", "NUM_DRAFT_TOKENS", "START", "END", "CORRID")
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args):
        bls.set_torch_threads(1)
        config = json.loads(args["model_config"])
        params = bls.model_parameters(config)
        ckpt = bls.resolve_checkpoint(params, args["model_repository"], require_weights=False)
        cfg = TrunkConfig.load(ckpt)
        tok = ChatTokenizer(ckpt / "tokenizer.json")
        idle_us = int(config.get("sequence_batching", {}).get("max_sequence_idle_microseconds", 600_000_000))
        self.max_ctx = min(int(params.get("max_ctx", "4096")), cfg.max_position_embeddings)
        log = pb_utils.Logger.log_error
        self.transport = bls.BLSTransport(pb_utils)
        trunk = bls.TrunkProxy(self.transport, vocab_size=cfg.vocab_size, on_error=log)
        drafter = bls.DrafterProxy(self.transport, on_error=log)
        self.front = TandemFront(trunk, drafter, tok.stop_ids, max_ctx=self.max_ctx,
                                 k=int(params.get("num_draft_tokens", "3")),
                                 burst_rounds=int(params.get("burst_rounds", "4")),
                                 max_k=int(params.get("max_draft_tokens", "8")),
                                 idle_timeout_s=idle_us / 1e6, log=log, info=pb_utils.Logger.log_info)
        pb_utils.Logger.log_info(f"tandem: checkpoint {ckpt}, max_ctx {self.max_ctx}, idle {idle_us / 1e6:.0f} s")

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()

            def send(arrays, error, final, sender=sender):
                resp = bls.make_response(pb_utils, arrays, error)
                sender.send(resp, flags=FINAL if final else 0)

            try:
                turn = bls.parse_turn(bls.request_arrays(pb_utils, request, INPUTS), request.correlation_id(),
                                      max_tokens_limit=self.max_ctx)
            except bls.StageRequestError as e:
                self.front.reject(send, str(e))
                continue
            self.front.submit(turn, send, sender.is_cancelled)
        return None

    def finalize(self):
        self.front.stop()
        pb_utils.Logger.log_info(f"tandem: BLS calls {self.transport.stats.summary()}")
