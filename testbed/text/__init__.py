"""Text in and out of the engine, for the API server and the offline LLM alike: chat templates rendered into
prompts (chat_utils.py) and token ids turned into text incrementally, with stop strings (detokenizer.py)."""
