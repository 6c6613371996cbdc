"""schemathesis hooks for scripts/api-fuzz.sh: send generated bodies of
POST /v1/images/import (application/x-tar) as raw bytes."""

import schemathesis


@schemathesis.serializer("application/x-tar")
def tar_body(ctx, value):
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, list):
        return bytes(v % 256 for v in value if isinstance(v, int))
    return str(value).encode()
