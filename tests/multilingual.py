"""Real text in several languages and scripts, shared by the dedup and language tests."""

# GSM8K's test split, item 0 (openai/gsm8k, main), as its dataset viewer shows it.
GSM8K_QUESTION = (
    "Janet’s ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes muffins for her "
    "friends every day with four. She sells the remainder at the farmers' market daily for $2 per fresh duck "
    "egg. How much in dollars does she make every day at the farmers' market?"
)

# GSM8K's item 0 as MGSM (juletxara/mgsm) translates it, in scripts written without spaces between words.
MGSM_ITEM_0 = {
    "zh": "珍妮的鸭子每天下 16 颗蛋。她每天早上早餐时吃 3 颗"
    "，每天用 4 颗为自己的朋友做松饼。剩下的鸭蛋她每天拿去农贸市场卖，"
    "每颗新鲜鸭蛋卖 2 美元。她每天在农贸市场赚多少钱？",
    "ja": "ジャネットのアヒルは1日に16個の卵を生みます。ジャネットは"
    "毎朝朝食に3個を消費し、毎日4個を使って友人のためにマフィンを焼きます。"
    "残りを市場で1個あたり2ドルの価格で売ります。彼女は毎日市場でいくら手に入れていますか？",
    "th": "เป็ดของเจเน็ตวางไข่วันละ 16 ฟอง เธอกินไข่ 3 ฟองเป็นอาหารเช้าทุกเช้า และอบมัฟฟินให้เพื่อนทุกวันโดยใช้ไข่ 4 ฟอง "
    "เธอขายไข่ที่เหลือที่ตลาดนัดเกษตรกรทุกวันในราคาฟองละ 2 ดอลลาร์ เธอได้เงินกี่ดอลลาร์ต่อวันที่ตลาดนัดเกษตรกร",
}
# The same topic in each language, other words: a prompt a decontaminated set must keep.
SAME_TOPIC = {
    "zh": "一位农民养了几只鸭子，鸭子每天都会下蛋。如果他把鸭蛋拿到集市上卖，一周能挣多少钱？请写出计算过程。",
    "ja": "農家がアヒルを飼っていて、アヒルは毎日卵を産みます。卵を市"
    "場で売ると、一週間でいくら稼げるでしょうか。計算の過程も書いてください。",
    "th": "ชาวนาคนหนึ่งเลี้ยงเป็ดไว้หลายตัว และเป็ดออกไข่ทุกวัน ถ้าเขานำไข่ไปขายที่ตลาด หนึ่งสัปดาห์จะได้เงินเท่าไร ช่วยแสดงวิธีคิดด้วย",
}
ASK = {
    "zh": "请一步一步地解答下面的题目。\n\n",
    "ja": "次の問題を段階的に解いてください。\n\n",
    "th": "โปรดแก้โจทย์ต่อไปนี้ทีละขั้นตอน\n\n",
}
PARAGRAPH = {  # a paragraph of ~150 characters, and the same with one character changed
    "zh": SAME_TOPIC["zh"] + "已知每只鸭子每天下一颗蛋，农民每天自己吃掉两颗，其余全部出售，每颗鸭蛋的价格是三元，"
    "集市每周开放七天，农民每天都去。请考虑鸭子偶尔生病不下蛋的情况，并说明你的假设。",
    "ja": SAME_TOPIC["ja"] + "アヒルは一羽につき一日一個の卵を産み、農家は毎日二個を自分で食べ、残りはすべて売ります。"
    "卵一個の値段は三十円で、市場は週に七日開いています。アヒルが病気で卵を産まない日も考えて、仮定を説明してください。",
    "th": SAME_TOPIC["th"] + " เป็ดแต่ละตัวออกไข่วันละหนึ่งฟอง ชาวนากินเองวันละสองฟอง ที่เหลือขายทั้งหมด ไข่ราคาฟองละสามบาท "
    "ตลาดเปิดทุกวันตลอดสัปดาห์ โปรดคิดถึงวันที่เป็ดป่วยและไม่ออกไข่ด้วย และอธิบายสมมติฐานของคุณ",
}
