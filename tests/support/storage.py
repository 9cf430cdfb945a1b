"""Helpers shared by the tests of storage."""

# Shorter per-request bounds than the defaults (5 s, 15 s, 8 s, 3 tries: 54 s), through the
# environment: the same stalls fail the same way, in an 11 s bound instead.
SHORT_BOUNDS = {
    "FRENZY_S3_CONNECT_TIMEOUT_S": "2",
    "FRENZY_S3_READ_TIMEOUT_S": "3",
    "FRENZY_S3_SEND_TIMEOUT_S": "2",
    "FRENZY_S3_ATTEMPTS": "2",
}
