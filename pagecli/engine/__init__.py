"""The engine: sequences, KV block manager, scheduler, model runner and the step loop."""
