# %% [markdown]
# A character-level LSTM language model (the char-RNN tutorials): embedding, a 2-layer
# LSTM, a linear decoder, truncated backprop with the hidden state detached between
# chunks, clip_grad_norm_, Adam.

# %% tags=["setup"]
import torch
import torch.nn as nn

device = "cuda"
vocab, emb, hidden, layers = 96, 256, 1024, 2

class CharRNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(vocab, emb)
        self.lstm = nn.LSTM(emb, hidden, layers, batch_first=True)
        self.decoder = nn.Linear(hidden, vocab)

    def forward(self, x, state=None):
        out, state = self.lstm(self.embed(x), state)
        return self.decoder(out), state

model = CharRNN().to(device)
optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
text = torch.randint(0, vocab, (32, 3 * 32 + 1), device=device)

# %% tags=["step"]
state = None
for i in range(0, 3 * 32, 32):
    x, y = text[:, i:i + 32], text[:, i + 1:i + 33]
    if state is not None:
        state = tuple(s.detach() for s in state)
    logits, state = model(x, state)
    loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), 5.0)
    optimizer.step()

# %% tags=["check"]
# embedding 96x256; LSTM layer l: w_ih 4h x in, w_hh 4h x h, two 4h biases; decoder h->96
sizes = [96 * 256,
         4096 * 256, 4096 * 1024, 4096, 4096,
         4096 * 1024, 4096 * 1024, 4096, 4096,
         96 * 1024, 96]
params = sum(rnd(n * 4) for n in sizes)
assert r.breakdown["parameters"] == params
# text: 32 x 97 int64 = 24,832 B
assert r.before == params + rnd(32 * 97 * 8)
# Adam's two moments; zero_grad(set_to_none=True) before backward: gradients are live in
# every step after the first's backward
assert r.after - r.before >= 3 * params   # gradients + exp_avg + exp_avg_sq
assert r.breakdown["optimizer_state"] in (0, 2 * params)

# %% tags=["corpus"]
# fp16 autocast halves the LSTM's saved gates; a smaller optimizer state (SGD keeps none);
# bf16 weights halve parameters, gradients and Adam's moments
WHATIF = [("amp", "fp16", "down"), ("weights_dtype", "bf16", "down"), ("grad_mode", "no_grad", "down")]
# measured on an H200 (results/gpu-check-nvidia-h200.json, "corpus_char_lstm"): AMP takes this
# step's peak from 444.0 MB down to 399.4 MB; simulated as cuDNN's RNN (its workspace for 2
# layers of 1024 over 32 x 32 steps scaled from the nearest shape measured): 412.8 -> 371.8 MB
