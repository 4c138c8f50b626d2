"""A budget σ on a device: what it is (in the daemon) and how a worker is held to it.

    partitioners.py   Partition = Advisory | Cpu | Green (msgspec), computed by pure functions
        │             from the node's layout: the daemon's side, no torch, no driver
        ▼ Grant.partition
    bind.py           Binder: the worker's side, the one place a process is put on its partition
    board.py          grants the client posts for its workers' processes, which follow them
                      (a green side, the KV room: what cannot be set from outside)
        ├─ cpu.py          core sets: the shares a core split can give, disjoint halves
        └─ green.py        GreenPartitions: disjoint green-context pairs of one device
             ├─ green_probe.py     can green contexts run here (driver, torch), GreenContextError
             ├─ green_backends.py  the cuda-python and torch primitives (split, open, close)
             └─ smsplit.py         SM counts of a split (pure; the daemon's descriptors use it too)
    cudagraphs.py     CUDA graphs captured per budget on its green stream
    mps.py            the MPS control daemon (processes of two jobs on one GPU at once)
    cpuquota.py       a CPU-time cap on a group of processes (cgroups): a static split finer than a core
    smid.py           SM-id census: did a stream's work stay on its partition's SMs? (one process, or two)
    fake_gpu.py       a FAKE GPU, named as such: green partitions and a launch log where no GPU is (CI)
"""
