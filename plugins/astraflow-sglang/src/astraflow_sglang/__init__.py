"""astraflow's SGLang rollout engine: `engine = "sglang"` in a recipe, pointed at a running SGLang server.

Written against SGLang's documented HTTP API of the 0.5 series (/generate with input_ids and
return_logprob, /pause_generation with a mode, /continue_generation, /update_weights_from_tensor and
/update_weights_from_disk with weight_version, /flush_cache, /get_server_info). It has been run only
against the FAKE server in tests/contract/fake_sglang.py, never against a real SGLang server.
"""

from __future__ import annotations

SGLANG_API_TARGETED = "0.5.x"
"""SGLang release series whose HTTP API this client follows (not run against any real release)."""
