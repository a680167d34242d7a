"""Agents written against the OpenAI API: an episode-scoped endpoint that records every call (`openai_agent`)."""
