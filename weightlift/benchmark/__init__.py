"""The benchmark behind ``weightlift bench``: weightlift against safetensors and the copy, read and
loopback floors on the user's checkpoint, fresh process per run, arms interleaved, medians and
spread. The research bench (peer loaders, weightlift's variants) lives in bench/, not installed,
and runs on this harness with a larger arm table. Nothing in the library imports it."""
