"""A fixed few-KB corpus the tiny test tokenizer is trained on.

Owns: CORPUS (engine.tiny trains the tiny checkpoints' tokenizer on it).

Mixed English prose with some accented, CJK and emoji text, so that the
byte-level BPE learns real merges and multi-byte characters get split across
tokens (what incremental detokenization must cope with).
"""

CORPUS = """\
The quick brown fox jumps over the lazy dog while the farmer watches from the porch.
A small language model is trained to predict the next token given all the tokens before it.
When the server receives a request, it checks the prompt, counts its tokens and puts it in a queue.
The scheduler takes requests from the queue and gives each one a free slot in the batch.
Every step of generation produces one new token for each busy slot, and then the loop repeats.
She opened the window, looked at the rain, and decided that the walk could wait until tomorrow.
Numbers such as 42, 3.14159, 2026 and 1,000,000 appear in text more often than you might think.
Questions? Answers! Lists: apples, oranges, pears; and parentheses (like these) are common too.
Once upon a time there was a little robot who wanted to learn how to write poems about the sea.
The weather today is sunny with a light breeze from the west and a high of twenty-three degrees.
Please remember to save your work often, because computers sometimes crash at the worst moment.
In the beginning the library was quiet, but by noon every table was covered with books and notes.
He said: "I will be there at seven o'clock", but he arrived at half past eight without an excuse.
Good software is tested, documented, and simple enough that a new reader can change it safely.
The river flows through the valley, past the old mill, and into the lake beyond the hills.
Cooking pasta is easy: boil water, add salt, add the pasta, stir, and taste it after ten minutes.
Mathematics describes patterns; physics describes the world; poetry describes how it feels.
Café, naïve, résumé, façade, jalapeño, Zürich, São Paulo, Kraków, smörgåsbord and crème brûlée.
Ästhetik, Übung, Straße, Größe, élève, garçon, señor, niño, coração, über alles, déjà vu.
你好，世界！今天天气很好。我们一起去公园散步吧。机器学习和自然语言处理。
日本語のテキストも少し含めます。ありがとうございます。東京は大きな都市です。
한국어 문장도 조금 있습니다. 안녕하세요, 만나서 반갑습니다.
Emoji make text fun 😀 🎉 🚀 ❤️ 👍 🌍 🍕 and sometimes confusing 🤔 for tokenizers.
Русский текст тоже встречается: привет, как дела? Ελληνικά: γεια σου κόσμε.
def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # prints 5
for i in range(10): total += i * i; if total > 100: break
{"name": "tiny", "layers": 2, "hidden": 64, "heads": 4, "vocab": 512}
The committee met on Tuesday to discuss the budget, the schedule, and the new building plans.
Birds sing in the morning; owls hunt at night; cats sleep almost all day long in the sun.
Reading a good book is like having a long conversation with someone very wise and patient.
The train to the city leaves every hour, on the hour, from platform number four.
If you can keep your head when all about you are losing theirs, you will be a fine engineer.
Water boils at one hundred degrees Celsius at sea level, and freezes at zero degrees.
They built a small wooden boat, painted it blue, and named it after their grandmother.
The museum has paintings, sculptures, old maps, ancient coins and a very large dinosaur.
Learning to play the piano takes years of practice, patience, and a little bit of joy.
Our team ships features every week, fixes bugs quickly, and writes clear release notes.
At the market we bought bread, cheese, tomatoes, olives, fresh herbs and a bottle of oil.
The mountain path was steep and rocky, yet the view from the top was worth every step.
Children laughed and played in the park while their parents talked on the benches nearby.
"""
