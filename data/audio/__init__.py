"""The audio path: audio -> SeamlessM4T features. The sources a corpus is shipped as (sources.py), the Seamless fbank
(fbank.py) and w2v-BERT's layer (features.py), w2v-BERT's relative-position attention kernels and their choice per
device (w2v_attention.py, w2v_attention_triton.py, attention_choice.py), its passes replayed from CUDA graphs
(w2v_graphs.py), how utterances are cut into passes and the per-device defaults (pass_plan.py), and the pipeline
that runs them in windows with decoding workers (pipeline.py). It stands on data's shard files and helpers; the
trainer's input never imports it."""
