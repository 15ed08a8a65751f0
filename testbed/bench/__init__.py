"""`testbed bench serve`: the HTTP load client of an OpenAI-compatible server (a client of the server, not part of it).

serve.py (the command: requests in, run directory out) -> datasets.py (trace / random / ShareGPT requests)
-> client.py (streaming requests, client-side timings).
"""
