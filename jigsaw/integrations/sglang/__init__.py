"""jigsaw inside SGLang: a general plugin for the scheduler process and the socket that receives its counts.

    plugin.py        entry point `sglang.srt.plugins` -> jigsaw.integrations.sglang.plugin:load
                     AROUND hook on Scheduler.run_batch: one datagram of counts per forward
    pdmux.py         AROUND hook on Scheduler.adjust_stream_groups: jigsaw's SM grant picks the decode
                     stream group (GPU-only, unverified)
    forward_sink.py  ForwardSink: binds the datagram socket in the rollout-server process, calls
                     on_forward(replica, prefill_tokens, decode_reqs)

Importing this package imports neither sglang nor torch; the hooks import sglang lazily.
"""
