"""The engine core in another process: the wire (length-prefixed msgpack frames of attrs
messages, no pickle), the messages both processes share (protocol.py), the front's stand-ins
for a remote or data-parallel core (remote.py), starting and reaping engine processes
(processes.py), and the engine process's own main (``python -m engine.transport.engine_process``).

Imports engine.core (the engine process runs a core actor) and the shared vocabulary.
"""
