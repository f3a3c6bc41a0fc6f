"""Anthropic's Messages API (`POST /v1/messages`) on the same engine as the OpenAI server."""
