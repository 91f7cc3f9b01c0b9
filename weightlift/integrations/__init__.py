"""Where weightlift plugs into the serving engines its users run: :mod:`weightlift.integrations.vllm`."""
