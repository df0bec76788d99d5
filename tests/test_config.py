"""Every bound the hardening added is itself bounded: `axonserve serve` refuses a zero or negative
value (exit 2, the setting named) before it starts anything."""

from __future__ import annotations

import subprocess
import sys

import pytest

BAD = [
    ("--max-request-fanout", "0", "max_fanout"),
    ("--max-stop-strings", "0", "max_stop_strings"),
    ("--max-stop-string-chars", "-1", "max_stop_string_chars"),
    ("--max-logit-bias", "0", "max_logit_bias"),
    ("--max-structured-output-bytes", "0", "max_structured_output_bytes"),
    ("--max-tools", "0", "max_tools"),
    ("--max-request-id-chars", "0", "max_request_id_chars"),
    ("--max-waiting", "-1", "max_waiting"),
    ("--max-waiting-tokens", "-5", "max_waiting_tokens"),
    ("--request-timeout", "-1", "request_timeout_s"),
    ("--chat-template-timeout", "0", "chat_template_timeout_s"),
    ("--profile-max-steps", "0", "profile_max_steps"),
    ("--profile-max-traces", "0", "profile_max_traces"),
    ("--max-image-pixels", "0", "max_image_pixels"),
    ("--max-image-decoded-bytes-per-request", "-1", "max_image_decoded_bytes_per_request"),
    ("--image-fetch-timeout-s", "0", "image_fetch_timeout_s"),
]


@pytest.mark.parametrize("flag,value,name", BAD, ids=[b[0] for b in BAD])
def test_serve_refuses_a_bound_that_bounds_nothing(smollm2_dir, flag, value, name):
    cmd = [sys.executable, "-m", "axonserve.cli", "serve", smollm2_dir, "--port", "1", flag, value]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert name in r.stderr, r.stderr[-2000:]
