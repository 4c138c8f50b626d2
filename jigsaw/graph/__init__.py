"""The sub-stage graph abstraction and its scheduling (JigsawRL §4.1, §4.3, §4.4).

    StepRecord ─► builder ─► SubStageGraph ─► schedule(...) ─► Plan
                                   │                 ▲
                                   └─ merge (ΔT, balancing) ─┘
"""
