"""Two tiny random XLM-RoBERTa models laid out as bge-m3 (an embedding model: XLMRobertaModel, CLS pooling
in its sentence-transformers files) and bge-reranker-v2-m3 (a reranker: XLMRobertaForSequenceClassification,
one label) lay theirs out, sharing one sentencepiece unigram vocabulary; saved as Hugging Face folders
<out>/embed and <out>/rerank for llama.cpp's converter."""
import json, os, sys
import sentencepiece as spm, torch
from transformers import XLMRobertaConfig, XLMRobertaForSequenceClassification, XLMRobertaModel, XLMRobertaTokenizerFast
out = sys.argv[1]; os.makedirs(out, exist_ok=True)
words = ["the", "cat", "sat", "on", "mat", "dog", "ran", "in", "park", "water", "boils", "at", "one", "hundred",
         "degrees", "paris", "is", "capital", "of", "france", "a", "city", "river", "bank", "money", "tree", "green",
         "blue", "sky", "sun", "rain", "what", "where", "how", "why", "who", "red", "fox", "jumps", "over", "lazy"]
corpus = os.path.join(out, "corpus.txt")
with open(corpus, "w") as f:
    for i in range(3000):
        f.write(" ".join(words[(i * 7 + j * 5) % len(words)] for j in range(6 + i % 5)) + " .\n")
# sentencepiece's default ids (<unk> 0, <s> 1, </s> 2), as XLM-R's sentencepiece.bpe.model has them: the converter
# realigns them to fairseq's (<s> 0, <pad> 1, </s> 2, <unk> 3)
spm.SentencePieceTrainer.train(input=corpus, model_prefix=os.path.join(out, "sentencepiece.bpe"), vocab_size=200,
                               model_type="unigram", hard_vocab_limit=False, minloglevel=2)
os.remove(corpus); os.remove(os.path.join(out, "sentencepiece.bpe.vocab"))
V = spm.SentencePieceProcessor(model_file=os.path.join(out, "sentencepiece.bpe.model")).get_piece_size() + 1
# the fast tokenizer's files too: its tokenizer.json's post-processor is where the converter reads that the
# tokenizer adds <s> and </s> (as bge-m3's GGUFs have it)
tokenizer = XLMRobertaTokenizerFast(vocab_file=os.path.join(out, "sentencepiece.bpe.model"), model_max_length=512)
cfg = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
           max_position_embeddings=514, type_vocab_size=1, pad_token_id=1, bos_token_id=0, eos_token_id=2)
for name, make in (("embed", lambda: XLMRobertaModel(XLMRobertaConfig(**cfg), add_pooling_layer=False)),
                   ("rerank", lambda: XLMRobertaForSequenceClassification(XLMRobertaConfig(**cfg, num_labels=1)))):
    d = os.path.join(out, name); os.makedirs(d, exist_ok=True)
    torch.manual_seed(1 if name == "embed" else 2)
    model = make().eval()
    with torch.no_grad():  # weights larger than the init's, so that texts embed and score apart (at the init's
        for n, p in model.named_parameters():  # scale every text came out within 0.001 of every other)
            if p.dim() > 1:
                p.mul_(6.0)
            if "LayerNorm.weight" in n:
                p.mul_(4.0)
    model.save_pretrained(d)
    os.link(os.path.join(out, "sentencepiece.bpe.model"), os.path.join(d, "sentencepiece.bpe.model"))
    tokenizer.save_pretrained(d)
    if name == "embed":  # sentence-transformers' pooling: the CLS token, normalized (bge-m3's)
        json.dump([{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                   {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}],
                  open(os.path.join(d, "modules.json"), "w"))
        os.makedirs(os.path.join(d, "1_Pooling"), exist_ok=True)
        json.dump({"word_embedding_dimension": 32, "pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False},
                  open(os.path.join(d, "1_Pooling", "config.json"), "w"))
os.remove(os.path.join(out, "sentencepiece.bpe.model"))
print("vocab", V)
